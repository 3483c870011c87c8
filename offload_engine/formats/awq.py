"""AWQ (quant_method "awq", GEMM layout): `qweight` [in, out/8] and `qzeros` [G, out/8], nibble i of each word
holding column 8k + [0,2,4,6,1,3,5,7][i], `scales` [G, out]; W[o, i] = (q - z) * s at group i // group. CPU kernel
form: 4-bit -> int4 (W = (u - 8) * s + (8 - z) * s)."""
from __future__ import annotations

import torch

from ..checkpoint.quant_config import QuantConfig
from .base import Parts, span
from .gptq import PackedInt32, group_rows, in_order, recognise_packed, zeros_and_scales
from .packing import F32, pair_bytes, unpack_int32
from .spec import QuantSpec, Recognition, ceil_div, compute_dtype, primary_name

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column k of a word lives in nibble AWQ_REVERSE_ORDER[k]


def columns(packed: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[rows, out/8] words -> [rows, out] nibbles in column order."""
    fields = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    return fields.index_select(2, order).reshape(packed.shape[0], -1)


class Awq(PackedInt32):
    kind = "awq"
    methods = ("awq",)

    def recognise(self, c: Recognition, cfg: QuantConfig) -> QuantSpec | None:
        got = recognise_packed(c, cfg)
        if got is None:
            return None
        q, qweight, module, groups = got
        per = 32 // cfg.bits
        c.add(primary_name(c.local, q), qweight, (c.inp, c.out // per), ("I32",), "qweight (AWQ GEMM layout)")
        zeros_and_scales(c, module, qweight, groups, per)
        return q

    def parts(self, q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        per, groups = 32 // q.bits, ceil_div(q.inp, q.group)
        return {"q": ((q.inp, q.out // per), "I32"), "zero": ((groups, q.out // per), "I32"),
                "scale": ((groups, q.out), scale_dtype or self.scale_dtype)}

    def cpu_path(self, q: QuantSpec, gguf_native: bool = False) -> str | None:
        return "cpu_int4" if q.bits == 4 and self.int4_group(q) is not None else None

    def int4_parts(self, q: QuantSpec, parts: Parts):
        if q.bits != 4 or not in_order(parts.get("g_idx"), q):
            return None
        order = torch.tensor(AWQ_REVERSE_ORDER)
        u, z = columns(parts["data"], order).t(), columns(parts["zero"], order)
        scale = parts["scale"].to(F32).t()  # [G, N] -> [N, G]
        return pair_bytes(u.to(torch.uint8)), scale, (8 - z).to(F32).t() * scale, span(q)

    def dequantize(self, q: QuantSpec, parts: Parts, dtype: torch.dtype | None) -> torch.Tensor:
        data, scale = parts["data"], parts["scale"]
        return dequantize_awq(data, parts.get("zero"), scale, q, compute_dtype(scale, dtype))


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, q: QuantSpec,
                   dtype: torch.dtype) -> torch.Tensor:
    order = torch.tensor(AWQ_REVERSE_ORDER, device=qweight.device)
    groups = group_rows(None, q, qweight.device)
    wt = (columns(qweight, order) - columns(qzeros, order)[groups]).to(F32) * scales.to(F32)[groups]
    return wt.t().to(dtype)


FORMAT = Awq()
