// The Python module of the native CPU kernels (bf16_cpu.cpp, int_cpu.cpp): one extension, one build per machine.
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x [M, K] @ W[N, K]^T in bfloat16 with fp32 accumulation");
  m.def("experts", &experts, "routed experts' gated SiLU MLPs, one call per layer");
  m.def("linears", &linears, "linear for several weights of one input, one parallel region");
  m.def("int_linears", &int_linears, "int_linear for several weights of one input, x quantized once");
  m.def("int4_block_rows", &int4_block_rows, "rows per block of the int4 pack the int kernels read (64 or 32)");
  m.def("int_linear", &int_linear, "x [M, K] @ W^T for an int8 / int4 kernel form, bfloat16 out");
  m.def("experts_int", &experts_int, "routed experts' gated SiLU MLPs over int8 / int4 kernel forms, one call");
  m.def("attend_one", &attend_one, "one query's QK-norm, RoPE, cache write and GQA attention over the cache");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of each row of x [M, H], bfloat16, as layers.rms_norm rounds it");
  m.def("combine_add", &combine_add, "x + the experts' parts summed in the given order (+ shared), one row");
}
