// The Python module of the native CPU kernels (ops.h): one extension, one build per machine.
//
// The compute kernels run without the GIL (`unlocked`): they touch no Python object once their arguments are
// converted (results are converted after it is taken back), and while one runs (a layer's experts take ~0.5 ms)
// the reader threads can run the Python between their system calls instead of waiting for the kernel to end
// (docs/PERF.md, session 25).
#include "ops.h"

namespace {
using unlocked = pybind11::call_guard<pybind11::gil_scoped_release>;
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, unlocked(), "x [M, K] @ W[N, K]^T in bfloat16 with fp32 accumulation");
  m.def("experts", &experts, unlocked(), "routed experts' gated SiLU MLPs, one call per layer");
  m.def("linears", &linears, unlocked(), "linear for several weights of one input, one parallel region");
  m.def("int_linears", &int_linears, unlocked(), "int_linear for several weights of one input, x quantized once");
  m.def("gguf_types", &gguf_types, "the ggml type ids whose GGUF forms the int kernels read in place");
  m.def("int4_block_rows", &int4_block_rows, "rows per block of the int4 pack the int kernels read (64 or 32)");
  m.def("int_linear", &int_linear, unlocked(), "x [M, K] @ W^T for an int8 / int4 kernel form, bfloat16 out");
  m.def("experts_int", &experts_int, unlocked(),
          "routed experts' gated SiLU MLPs over int8 / int4 kernel forms, one call");
  m.def("attend_one", &attend_one, unlocked(),
          "one query's QK-norm, RoPE, cache write and GQA attention over the cache");
  m.def("rms_norm_rows", &rms_norm_rows, unlocked(),
          "RMSNorm of each row of x [M, H], bfloat16, as layers.rms_norm rounds it");
  m.def("combine_add", &combine_add, unlocked(),
          "x + the experts' parts summed in the given order (+ shared), one row");
  m.def("moe_row", &moe_row, unlocked(), "residual + one row's routed experts summed in the given order (+ shared)");
  m.def("attention_block", &attention_block, unlocked(),
          "a decode step's norm, q/k/v, attention, o_proj, residual, norm, router");
  pybind11::class_<DecodePlan>(m, "DecodePlan", "a resident model's one-token decode step over all its layers")
      .def(pybind11::init<double, double, int64_t, bool>())
      .def("add_layer", &DecodePlan::add_layer, "the next layer's norms, attention and router forms, its experts'")
      .def("run", &DecodePlan::run, unlocked(),
              "x [1, H] through every layer -> {x, the routed experts [layers, top_k]}")
      .def_property_readonly("layers", &DecodePlan::layers);
}
