// The native kernels' C++ entry points (bf16_cpu.cpp, int_cpu.cpp, decode_cpu.cpp, layer_cpu.cpp, decode_plan.cpp),
// declared once: bindings.cpp exposes them to Python, layer_cpu.cpp and decode_plan.cpp compose them.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <vector>

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
    std::vector<std::vector<torch::Tensor>> gates, ups, downs;  // every expert's, by expert index
  };
  std::vector<Layer> layers_;
  double eps_, scale_;
  int64_t top_k_;
  bool normalize_;
};
