// A one-token decode step's two blocks, one call each: the kernels a standard layer's decode step would call one by
// one from Python, composed here in the same order with the same arguments, so the results are those calls' bits.
// What it saves is the Python and dispatch between them (~150 us a layer for the attention block on a 2-core CPU,
// docs/PERF.md).
// attention_block: runtime/arch/base.StandardOps's input norm, q/k/v, attend_one, o_proj, the residual add, the
//   post-attention norm and the router.
// moe_row: runtime/model.CausalLM.moe's routed experts of one row (experts / experts_int) and combine_add.
//
// A weight is given as its kernel form: [W] for a plain bf16 weight (linear / linears), [q, scale(, zero term)]
// for an int8 / int4 one (int_linear / int_linears); the caller passes only forms its kernel choices send to
// these kernels.
#include "ops.h"

namespace {

bool plain(const std::vector<torch::Tensor>& form) { return form.size() == 1; }

torch::Tensor project(const torch::Tensor& x, const std::vector<torch::Tensor>& form) {
  return plain(form) ? ::linear(x, form[0]) : ::int_linear(x, form);  // ::linear, not torch::linear
}

}  // namespace

// x [1, H] -> {x + o_proj(attention(input_norm(x))), post_norm of that, its router logits (or an empty tensor
// where `router` is empty: a dense layer)}; qkv: three forms, all plain or all int
std::vector<torch::Tensor> attention_block(const torch::Tensor& x, const torch::Tensor& input_norm,
                                           const torch::Tensor& post_norm, double eps,
                                           const std::vector<std::vector<torch::Tensor>>& qkv,
                                           const std::optional<torch::Tensor>& q_norm,
                                           const std::optional<torch::Tensor>& k_norm, const torch::Tensor& cos,
                                           const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                           int64_t start, double scale, const std::vector<torch::Tensor>& o_proj,
                                           const std::vector<torch::Tensor>& router) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "attention_block: expected one row [1, hidden]");
  TORCH_CHECK(qkv.size() == 3, "attention_block: expected the q, k and v forms");
  const auto h = rms_norm_rows(x, input_norm, eps);
  std::vector<torch::Tensor> proj;
  if (plain(qkv[0]) && plain(qkv[1]) && plain(qkv[2])) {
    proj = ::linears(h, {qkv[0][0], qkv[1][0], qkv[2][0]});
  } else {
    TORCH_CHECK(!plain(qkv[0]) && !plain(qkv[1]) && !plain(qkv[2]), "attention_block: q, k, v all plain or all int");
    proj = ::int_linears(h, qkv);
  }
  const auto attended = attend_one(proj[0], proj[1], proj[2], q_norm, k_norm, eps, cos, sin, k_cache, v_cache,
                                   start, scale);
  // the residual add: combine_add of the one part is torch's bf16 x + y (0 + y is y exactly)
  auto out = combine_add(x, {project(attended, o_proj)}, std::nullopt);
  auto normed = rms_norm_rows(out, post_norm, eps);
  auto logits = router.empty() ? torch::Tensor() : project(normed, router);
  return {out, normed, logits};
}

ExpertForms expert_forms(const std::vector<torch::Tensor>& gate, const std::vector<torch::Tensor>& up,
                         const std::vector<torch::Tensor>& down, int64_t e) {
  ExpertForms f;
  if (plain(gate)) {
    TORCH_CHECK(up.size() == 1 && down.size() == 1, "expert ", e, ": gate, up and down all plain or all int");
    f.gate = plain_matrix(gate[0], "gate", e), f.up = plain_matrix(up[0], "up", e);
    f.down = plain_matrix(down[0], "down", e);
    TORCH_CHECK(f.gate.N == f.up.N && f.gate.K == f.up.K && f.down.K == f.gate.N, "expert ", e,
                ": gate/up/down shapes do not chain");
    f.inter = f.gate.N;
    return f;
  }
  TORCH_CHECK(!down.empty() && !plain(down) && (up.empty() || !plain(up)), "expert ", e,
              ": gate, up and down all plain or all int");
  f.quantized = true;
  f.qgate = int_form(gate, "gate", e);
  const bool fused = up.empty();
  if (!fused) f.qup = int_form(up, "up", e);  // else N == 0: the gate is the fused gate_up form
  f.qdown = int_form(down, "down", e);
  f.inter = fused ? f.qgate.N / 2 : f.qgate.N;
  TORCH_CHECK((fused ? f.qgate.N % 2 == 0 : f.qup.K == f.qgate.K && f.qup.N == f.qgate.N) && f.qdown.K == f.inter,
              "expert ", e, ": gate/up/down shapes do not chain");
  return f;
}

std::vector<torch::Tensor> experts_on(const std::vector<torch::Tensor>& xs, const std::vector<ExpertForms>& forms,
                                      const std::vector<torch::Tensor>& weights) {
  using offload_native::bf16;
  const size_t E = xs.size();
  TORCH_CHECK(forms.size() == E && weights.size() == E, "one x, gate, up, down and weight per expert");
  std::vector<const ExpertForms*> chosen(E);
  std::vector<ExpertRows> rows(E);
  std::vector<torch::Tensor> out(E), wts(E);
  for (size_t e = 0; e < E; ++e) {
    const ExpertForms& f = forms[e];
    TORCH_CHECK(f.quantized == forms[0].quantized, "experts all plain or all int");
    const int64_t K = f.quantized ? f.qgate.K : f.gate.K, H = f.quantized ? f.qdown.N : f.down.N;
    const auto& x = xs[e];
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
                "x of expert ", e, ": expected a 2-D CPU bfloat16 tensor with contiguous rows");
    TORCH_CHECK(x.size(1) == K, "x of expert ", e, " has ", x.size(1), " columns, the gate ", K);
    TORCH_CHECK(weights[e].scalar_type() == torch::kBFloat16 && weights[e].numel() == x.size(0), "expert ", e,
                ": expected one bfloat16 routing weight per token");
    wts[e] = weights[e].contiguous();
    out[e] = torch::empty({x.size(0), H}, x.options());
    rows[e] = {reinterpret_cast<const bf16*>(x.data_ptr()), x.stride(0), x.size(0),
               reinterpret_cast<const bf16*>(wts[e].data_ptr()), 1, reinterpret_cast<bf16*>(out[e].data_ptr()), H};
    chosen[e] = &f;
  }
  if (E > 0 && forms[0].quantized) run_experts_int(chosen, rows);
  else if (E > 0) run_experts_plain(chosen, rows);
  return out;
}

// residual + the routed experts of one row x [1, H], summed in the order given (the caller's ascending expert
// order) (+ shared): combine_add's sum of the experts' parts (run_experts_plain / run_experts_int). weights [k]
// bf16: the row's routing weights; slots[e]: expert e's place among them; gates / ups / downs[e]: [W] (plain) or
// int kernel parts, all experts of one kind (an empty up: a fused gate_up form)
torch::Tensor moe_row(const torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& weights,
                      const std::vector<int64_t>& slots, const std::vector<std::vector<torch::Tensor>>& gates,
                      const std::vector<std::vector<torch::Tensor>>& ups,
                      const std::vector<std::vector<torch::Tensor>>& downs,
                      const std::optional<torch::Tensor>& shared) {
  const size_t E = slots.size();
  TORCH_CHECK(gates.size() == E && ups.size() == E && downs.size() == E, "moe_row: one gate, up, down per expert");
  std::vector<ExpertForms> forms(E);
  std::vector<const ExpertForms*> chosen(E);
  for (size_t e = 0; e < E; ++e) {
    TORCH_CHECK(plain(gates[e]) == plain(gates[0]), "moe_row: experts all plain or all int");
    forms[e] = expert_forms(gates[e], ups[e], downs[e], static_cast<int64_t>(e));
    chosen[e] = &forms[e];
  }
  return moe_row_forms(residual, x, weights, slots, chosen, shared);
}

torch::Tensor moe_row_forms(const torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& weights,
                            const std::vector<int64_t>& slots, const std::vector<const ExpertForms*>& forms,
                            const std::optional<torch::Tensor>& shared) {
  using offload_native::bf16;
  const size_t E = slots.size();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weights.dim() == 1, "moe_row: expected one row and its weights");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              "moe_row: x must be a CPU bfloat16 row");
  TORCH_CHECK(weights.scalar_type() == torch::kBFloat16, "moe_row: expected bfloat16 routing weights");
  TORCH_CHECK(forms.size() == E, "moe_row: one expert per slot");
  TORCH_CHECK(residual.device().is_cpu() && residual.scalar_type() == torch::kBFloat16 && residual.is_contiguous(),
              "moe_row: the residual must be a contiguous CPU bfloat16 row");
  const int64_t H = residual.numel();
  if (shared) {
    TORCH_CHECK(shared->device().is_cpu() && shared->scalar_type() == torch::kBFloat16 && shared->is_contiguous() &&
                    shared->numel() == H,
                "moe_row: the shared experts' output must be a contiguous CPU bfloat16 row of ", H);
  }
  const bool quantized = E > 0 && forms[0]->quantized;
  thread_local std::vector<bf16> parts_tl;  // [E, H]: each expert's part
  std::vector<bf16>& parts = parts_tl;
  if (parts.size() < E * static_cast<size_t>(H)) parts.resize(E * H);
  std::vector<ExpertRows> rows(E);
  std::vector<const bf16*> part_rows(E);
  const bf16* w = reinterpret_cast<const bf16*>(weights.data_ptr());
  for (size_t e = 0; e < E; ++e) {
    const ExpertForms& f = *forms[e];
    TORCH_CHECK(slots[e] >= 0 && slots[e] < weights.size(0), "moe_row: slot ", slots[e], " outside the weights");
    TORCH_CHECK(f.quantized == quantized, "moe_row: experts all plain or all int");
    TORCH_CHECK((quantized ? f.qgate.K : f.gate.K) == x.size(1) && (quantized ? f.qdown.N : f.down.N) == H,
                "moe_row: expert ", e, " does not map the row's ", x.size(1), " values to the residual's ", H);
    rows[e] = {reinterpret_cast<const bf16*>(x.data_ptr()), x.stride(0), 1, w + slots[e] * weights.stride(0), 0,
               parts.data() + e * H, H};
    part_rows[e] = parts.data() + e * H;
  }
  if (quantized) run_experts_int(forms, rows);
  else if (E > 0) run_experts_plain(forms, rows);
  auto out = torch::empty_like(residual);
  combine_rows(reinterpret_cast<const bf16*>(residual.data_ptr()), part_rows,
               shared ? reinterpret_cast<const bf16*>(shared->data_ptr()) : nullptr,
               reinterpret_cast<bf16*>(out.data_ptr()), H);
  return out;
}
