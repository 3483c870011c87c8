"""Quantized weights -> dense [out, in] matrices in the compute dtype, by format: each format's definition and its
function live in its module in formats/ (fp8_block, compressed_tensors, gptq, awq, mxfp4); the names here are the
runtime's and the tests' short way to them.

  fp8_block   W = q * scale_inv[i // b0, j // b1]                       (DeepSeek-V3 / Kimi K2 / Qwen FP8)
  ct_pack     W = (q - zero) * scale, q unpacked from int32 words       (compressed-tensors pack-quantized)
  ct_naive    W = (q - zero) * scale, q int8 or fp8                     (int- / float-quantized)
  gptq        W[o, i] = (q - (z + offset)) * s at group g_idx[i]
  awq         W[o, i] = (q - z) * s at group i // group, AWQ's nibble order
  mxfp4       two e2m1 values per byte, one e8m0 exponent per 32 values

The arithmetic is done in float32 (exact: small integers times one scale) and rounded once to `dtype`.
"""
from __future__ import annotations

from ..formats.awq import AWQ_REVERSE_ORDER  # noqa: F401
from ..formats.awq import dequantize_awq as awq  # noqa: F401
from ..formats.compressed_tensors import dequantize_ct_naive as ct_naive  # noqa: F401
from ..formats.compressed_tensors import dequantize_ct_pack as ct_pack  # noqa: F401
from ..formats.fp8_block import dequantize_fp8_block as fp8_block  # noqa: F401
from ..formats.gptq import dequantize_gptq as gptq  # noqa: F401
from ..formats.mxfp4 import FP4_VALUES  # noqa: F401
from ..formats.mxfp4 import dequantize_mxfp4 as mxfp4  # noqa: F401
from ..formats.packing import F32, float32_of, unpack_int32  # noqa: F401
