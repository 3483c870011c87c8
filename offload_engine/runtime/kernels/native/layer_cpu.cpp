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

// residual + the routed experts of one row x [1, H], summed in the order given (the caller's ascending expert
// order) (+ shared): combine_add over experts() / experts_int()'s parts. weights [k] bf16: the row's routing
// weights; slots[e]: expert e's place among them; gates / ups / downs[e]: [W] (plain) or int kernel parts, all
// experts of one kind (an empty up: a fused gate_up form)
torch::Tensor moe_row(const torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& weights,
                      const std::vector<int64_t>& slots, const std::vector<std::vector<torch::Tensor>>& gates,
                      const std::vector<std::vector<torch::Tensor>>& ups,
                      const std::vector<std::vector<torch::Tensor>>& downs,
                      const std::optional<torch::Tensor>& shared) {
  const size_t E = slots.size();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weights.dim() == 1, "moe_row: expected one row and its weights");
  TORCH_CHECK(gates.size() == E && ups.size() == E && downs.size() == E, "moe_row: one gate, up, down per expert");
  std::vector<torch::Tensor> xs(E, x), ws(E);
  for (size_t e = 0; e < E; ++e) {
    TORCH_CHECK(slots[e] >= 0 && slots[e] < weights.size(0), "moe_row: slot ", slots[e], " outside the weights");
    ws[e] = weights.narrow(0, slots[e], 1);
  }
  const bool plain_all = E > 0 && plain(gates[0]);
  std::vector<torch::Tensor> parts;
  if (plain_all) {
    std::vector<torch::Tensor> g(E), u(E), d(E);
    for (size_t e = 0; e < E; ++e) {
      TORCH_CHECK(plain(gates[e]) && plain(ups[e]) && plain(downs[e]), "moe_row: experts all plain or all int");
      g[e] = gates[e][0], u[e] = ups[e][0], d[e] = downs[e][0];
    }
    parts = ::experts(xs, g, u, d, ws);
  } else if (E > 0) {
    for (size_t e = 0; e < E; ++e)
      TORCH_CHECK(!plain(gates[e]), "moe_row: experts all plain or all int");
    parts = ::experts_int(xs, gates, ups, downs, ws);
  }
  return combine_add(residual, parts, shared);
}
