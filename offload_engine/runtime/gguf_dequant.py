"""GGUF tensor types -> float32: the block decoders are formats/gguf_blocks.py's (the GGUF WeightFormat's,
formats/gguf.py); the names here are the runtime's, the tools' and the tests' way to them."""
from __future__ import annotations

from ..formats.gguf_blocks import (BLOCKS, INT4_TYPES, IQ4_VALUES, MXFP4_VALUES, NATIVE_TYPES, PLAIN,  # noqa: F401
                                   SUPPORTED, dequantize, int4_parts, iq4_xs, kv_b, mxfp4, native_form, q4_0, q4_k,
                                   q5_k, q6_k, q8_0, rows, unpermute, weight)
