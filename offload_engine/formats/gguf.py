"""GGUF block types (read in place from .gguf files: checkpoint/gguf/model.py gives each weight a QuantSpec "gguf"
with its tensor type, or "gguf_kvb" for DeepSeek's kv_b_proj that llama.cpp stores split as k_b and v_b). The
block decoders and their layout table are formats/gguf_blocks.py; per type family:
  Q8_0, Q4_0 (blocks of 32), Q4_K / Q5_K / Q6_K / IQ4_XS (super-blocks of 256), MXFP4 (blocks of 32)
Kernel forms: in a bf16 compute the native CPU kernels read the NATIVE_TYPES' blocks in place (cpu_gguf); in
float32 Q4_0 / Q4_K take torch's int4 kernel (INT4_TYPES: W = (u - 8) * s + t per 32, exactly); the rest
dequantize."""
from __future__ import annotations

import torch

from . import gguf_blocks
from .base import Parts, WeightFormat
from .packing import F32, pair_bytes
from .spec import QuantSpec

# the types the native CPU kernels multiply in place in a bf16 compute (runtime/kernels/native/gguf_cpu.cpp: their
# form is a view of the stored blocks, no bytes beside them; a checkpoint made only of these computes in bfloat16:
# checkpoint/gguf/config.compute_dtype)
GGUF_NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4")
INT4_TYPES = gguf_blocks.INT4_TYPES
PLAIN_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def stored_bytes(gtype: str, values: int) -> int:
    """Bytes of `values` values of GGUF type `gtype` (whole blocks)."""
    if gtype in PLAIN_BYTES:
        return values * PLAIN_BYTES[gtype]
    per, size, _ = gguf_blocks.BLOCKS[gtype]
    return values // per * size


class Gguf(WeightFormat):
    kind = "gguf"

    def label(self, q: QuantSpec) -> str:
        return f"gguf {q.gtype}"

    def parts(self, q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"q": ((q.out, stored_bytes(q.gtype, q.inp)), "U8")}  # the scales live inside the blocks

    def int4_group(self, q: QuantSpec) -> int | None:
        return 32 if q.gtype in INT4_TYPES and not q.out % 16 and not q.inp % 32 else None

    def cpu_path(self, q: QuantSpec, gguf_native: bool = False) -> str | None:
        if gguf_native and q.gtype in GGUF_NATIVE_TYPES:
            return "cpu_gguf"
        return "cpu_int4" if self.int4_group(q) is not None else None  # Q4_0 / Q4_K; the others dequantize

    def int4_parts(self, q: QuantSpec, parts: Parts):
        u, scale, term = gguf_blocks.int4_parts(parts["data"], q)
        return pair_bytes(u.to(torch.uint8)), scale, term, 32

    def dequantize(self, q: QuantSpec, parts: Parts, dtype: torch.dtype | None) -> torch.Tensor:
        return gguf_blocks.weight(parts["data"], q, dtype or F32)

    def rows(self, q: QuantSpec, parts: Parts, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        return gguf_blocks.rows(parts["data"], tokens, q, dtype)


class GgufKvb(WeightFormat):
    """kv_b_proj [H * (nope + v), kv_lora] from k_b [H, kv_lora, nope] (the data) and v_b [H, v, kv_lora] ("vb");
    q.group holds nope, q.heads H, q.gtype / q.gtype2 the two parts' types."""

    kind = "gguf_kvb"

    def label(self, q: QuantSpec) -> str:
        return f"gguf {q.gtype}"

    def parts(self, q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        v = q.out // q.heads - q.group
        return {"q": ((q.heads * q.inp, stored_bytes(q.gtype, q.group)), "U8"),
                "vb": ((q.heads * v, stored_bytes(q.gtype2, q.inp)), "U8")}

    def cpu_path(self, q: QuantSpec, gguf_native: bool = False) -> str | None:
        # (as planned since GGUF came in: the generic int4 group test, so room is kept for an int4 form that
        # int4_parts never builds; the weight dequantizes)
        return "cpu_int4" if self.int4_group(q) is not None else None

    def dequantize(self, q: QuantSpec, parts: Parts, dtype: torch.dtype | None) -> torch.Tensor:
        return gguf_blocks.kv_b(parts["data"], parts["vb"], q, dtype or F32)


GGUF, GGUF_KVB = Gguf(), GgufKvb()
