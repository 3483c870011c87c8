"""Fast compute for quantized weights: select.py picks the path per format and device; cpu_int.py (torch's
weight-only int8/int4 CPU kernels), triton_int.py (CUDA fused dequantize-and-multiply), fp8.py (CUDA
torch._scaled_mm). Where none applies, runtime/linear.py dequantizes."""
