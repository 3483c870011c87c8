"""`offload-engine quantize`: a bf16/fp16/fp32 checkpoint rewritten as compressed-tensors int8/int4/fp8.

plan.py decides which tensors and how (from headers), scheme.py is the per-row math and the stored layout,
writer.py the streaming safetensors I/O and the staging folder, convert.py the run, command.py the CLI.
"""
from .plan import QuantizeOptions

__all__ = ["QuantizeOptions"]
