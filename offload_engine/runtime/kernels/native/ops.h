// The native kernels' C++ entry points (bf16_cpu.cpp, int_cpu.cpp, decode_cpu.cpp, layer_cpu.cpp, decode_plan.cpp),
// declared once: bindings.cpp exposes them to Python, layer_cpu.cpp and decode_plan.cpp compose them.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "bf16_util.h"
#include "int_input.h"

// One routed expert's gated SiLU MLP weights, checked once (expert_forms): plain bf16 matrices [N, K] (rows ld
// apart) or int8 / int4 kernel forms (quantized); an int `up` with N == 0: `gate` is the fused gate_up form (2I rows)
struct PlainMatrix {
  const offload_native::bf16* W = nullptr;
  int64_t N = 0, K = 0, ld = 0;
};
struct ExpertForms {
  bool quantized = false;
  PlainMatrix gate, up, down;  // plain
  offload_native::Form qgate, qup, qdown;  // quantized
  int64_t inter = 0;  // I: the gate's (and up's) output width
};
// the rows routed to one expert, their routing weights and where its part goes
struct ExpertRows {
  const offload_native::bf16* x;
  int64_t ldx, M;
  const offload_native::bf16* weight;  // M routing weights, weight_step apart
  int64_t weight_step;
  offload_native::bf16* out;  // [M, H], ldo apart
  int64_t ldo;
};
ExpertForms expert_forms(const std::vector<torch::Tensor>& gate, const std::vector<torch::Tensor>& up,
                         const std::vector<torch::Tensor>& down, int64_t e);
PlainMatrix plain_matrix(const torch::Tensor& W, const char* what, int64_t e);
offload_native::Form int_form(const std::vector<torch::Tensor>& parts, const char* what, int64_t e);
// gguf_cpu.cpp: a GGUF form ([blocks, meta]: int_form takes it too) and its rows [n0, n1) for every row of x
offload_native::Form gguf_form(const torch::Tensor& blocks, const torch::Tensor& meta, const char* what, int64_t e);
void gguf_rows(const offload_native::Form& f, const offload_native::Act& a, int64_t n0, int64_t n1,
               offload_native::bf16* out, int64_t ldo);
std::vector<int64_t> gguf_types();
// every expert's part for its rows, one parallel region per stage; all experts plain (bf16_cpu.cpp) or all
// quantized (int_cpu.cpp)
// Their scratch stays allocated after calls of at most kKeptRows rows in all (the runtime sends at most 16 rows of x,
// kernels/decode.py MAX_ROWS, times top-k), and is freed after larger ones, which would otherwise hold their peak
constexpr int64_t kKeptRows = 256;
inline bool keeps_scratch(const std::vector<ExpertRows>& rows) {
  int64_t total = 0;
  for (const auto& r : rows) total += r.M;
  return total <= kKeptRows;
}
void run_experts_plain(const std::vector<const ExpertForms*>& forms, const std::vector<ExpertRows>& rows);
void run_experts_int(const std::vector<const ExpertForms*>& forms, const std::vector<ExpertRows>& rows);
// the Python-facing experts() / experts_int(): xs[e] [M_e, K] the rows routed to expert e, weights[e] their M_e
// bf16 routing weights -> each expert's part [M_e, H] (layer_cpu.cpp)
std::vector<torch::Tensor> experts_on(const std::vector<torch::Tensor>& xs, const std::vector<ExpertForms>& forms,
                                      const std::vector<torch::Tensor>& weights);
// x + parts summed in the order given (+ shared), one row of H (decode_cpu.cpp; combine_add's arithmetic)
void combine_rows(const offload_native::bf16* x, const std::vector<const offload_native::bf16*>& parts,
                  const offload_native::bf16* shared, offload_native::bf16* out, int64_t H);

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& W);
std::vector<torch::Tensor> experts(const std::vector<torch::Tensor>& xs, const std::vector<torch::Tensor>& gates,
                                   const std::vector<torch::Tensor>& ups, const std::vector<torch::Tensor>& downs,
                                   const std::vector<torch::Tensor>& weights);
std::vector<torch::Tensor> linears(const torch::Tensor& x, const std::vector<torch::Tensor>& Ws);
torch::Tensor int_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts);
int64_t int4_block_rows();
std::vector<torch::Tensor> int_linears(const torch::Tensor& x, const std::vector<std::vector<torch::Tensor>>& forms);
std::vector<torch::Tensor> experts_int(const std::vector<torch::Tensor>& xs,
                                       const std::vector<std::vector<torch::Tensor>>& gates,
                                       const std::vector<std::vector<torch::Tensor>>& ups,
                                       const std::vector<std::vector<torch::Tensor>>& downs,
                                       const std::vector<torch::Tensor>& weights);

torch::Tensor attend_one(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const std::optional<torch::Tensor>& q_norm, const std::optional<torch::Tensor>& k_norm,
                         double eps, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, int64_t start, double scale);
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor combine_add(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                          const std::optional<torch::Tensor>& shared);
std::vector<torch::Tensor> attention_block(const torch::Tensor& x, const torch::Tensor& input_norm,
                                           const torch::Tensor& post_norm, double eps,
                                           const std::vector<std::vector<torch::Tensor>>& qkv,
                                           const std::optional<torch::Tensor>& q_norm,
                                           const std::optional<torch::Tensor>& k_norm, const torch::Tensor& cos,
                                           const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                           int64_t start, double scale, const std::vector<torch::Tensor>& o_proj,
                                           const std::vector<torch::Tensor>& router);
torch::Tensor moe_row(const torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& weights,
                      const std::vector<int64_t>& slots, const std::vector<std::vector<torch::Tensor>>& gates,
                      const std::vector<std::vector<torch::Tensor>>& ups,
                      const std::vector<std::vector<torch::Tensor>>& downs,
                      const std::optional<torch::Tensor>& shared);
// moe_row over forms checked once (the decode plan's): forms[i] the expert of weight slot slots[i]
torch::Tensor moe_row_forms(const torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& weights,
                            const std::vector<int64_t>& slots, const std::vector<const ExpertForms*>& forms,
                            const std::optional<torch::Tensor>& shared);

// decode_plan.cpp: a one-token decode step over every layer of a model whose weights are all resident, one call
// (runtime/decode_plan.py builds it once, from the weights' kernel forms)
class DecodePlan {
 public:
  DecodePlan(double eps, double scale, int64_t top_k, bool normalize)
      : eps_(eps), scale_(scale), top_k_(top_k), normalize_(normalize) {}
  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                 const std::vector<std::vector<torch::Tensor>>& qkv, const std::optional<torch::Tensor>& q_norm,
                 const std::optional<torch::Tensor>& k_norm, const std::vector<torch::Tensor>& o_proj,
                 const std::vector<torch::Tensor>& router, const std::vector<std::vector<torch::Tensor>>& gates,
                 const std::vector<std::vector<torch::Tensor>>& ups,
                 const std::vector<std::vector<torch::Tensor>>& downs);
  std::vector<torch::Tensor> run(const torch::Tensor& x, const std::vector<torch::Tensor>& k_caches,
                                 const std::vector<torch::Tensor>& v_caches, const torch::Tensor& cos,
                                 const torch::Tensor& sin, int64_t start) const;
  int64_t layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Layer {
    torch::Tensor input_norm, post_norm;
    std::vector<std::vector<torch::Tensor>> qkv;
    std::optional<torch::Tensor> q_norm, k_norm;
    std::vector<torch::Tensor> o_proj, router;
    std::vector<std::vector<torch::Tensor>> gates, ups, downs;  // every expert's, by expert index (kept alive)
    std::vector<ExpertForms> experts;  // the same, checked once
  };
  std::vector<Layer> layers_;
  double eps_, scale_;
  int64_t top_k_;
  bool normalize_;
};
