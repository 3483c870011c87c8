"""GPTQ (quant_method "gptq", AutoGPTQ / gptqmodel): `qweight` [in/p, out] packed along the inputs, `qzeros`
[G, out/p] along the outputs, `scales` [G, out], optional `g_idx` [in] (act-order); W[o, i] = (q - (z + offset))
* s at group g_idx[i] (default i // group; v1 checkpoints store zero - 1: offset 1). CPU kernel forms: 4-bit in
input order -> int4, 8-bit with one group -> int8 per channel; act-order permutations dequantize."""
from __future__ import annotations

import torch

from ..checkpoint.quant_config import QuantConfig
from ..errors import CheckpointFormatError
from .base import Parts, WeightFormat, span
from .packing import F32, pair_bytes, unpack_int32
from .spec import FLOATS, QuantSpec, Recognition, ceil_div, compute_dtype, part_name, primary_name


def in_order(g_idx: torch.Tensor | None, q: QuantSpec) -> bool:
    """GPTQ without act-order: g_idx absent or input i in group i // group (a permutation needs dequantizing)."""
    return g_idx is None or torch.equal(g_idx.to(torch.long).cpu(), torch.arange(q.inp) // q.group)


def group_rows(g_idx: torch.Tensor | None, q: QuantSpec, device: torch.device) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.to(torch.long)
    return torch.arange(q.inp, device=device) // q.group


def recognise_packed(c: Recognition, cfg: QuantConfig) -> tuple[QuantSpec, object, str, int] | None:
    """GPTQ's and AWQ's shared start: (spec, qweight record, module, groups), or None where the weight is kept."""
    module = c.spec.hf_name.removesuffix(".weight")
    qweight = c.get(module + ".qweight")
    if qweight is None:
        return None
    per = 32 // cfg.bits
    group = c.inp if cfg.group_size == -1 else cfg.group_size
    if c.inp % group or c.inp % per or c.out % per:
        raise CheckpointFormatError(qweight.file, f"group_size {cfg.group_size} and {cfg.bits}-bit packing do not "
                                                  f"divide the [{c.out}, {c.inp}] weight", tensor=qweight.name)
    q = QuantSpec(cfg.method, c.out, c.inp, bits=cfg.bits, group=group, symmetric=cfg.sym,
                  zero_offset=cfg.zero_offset)
    return q, qweight, module, c.inp // group


class PackedInt32(WeightFormat):
    """GPTQ's and AWQ's shared answers: int32 words of 4- or 8-bit values, fp16 `.scales` per group."""
    scale_dtype = "F16"

    def planned(self, cfg: QuantConfig, unit_kind: str, module: str, out: int, inp: int) -> QuantSpec | None:
        return QuantSpec(cfg.method, out, inp, bits=cfg.bits, group=inp if cfg.group_size == -1 else cfg.group_size,
                         symmetric=cfg.sym, zero_offset=cfg.zero_offset)

    def scale_names(self, hf_name: str) -> tuple[str, ...]:
        return (hf_name.removesuffix(".weight") + ".scales",)


class Gptq(PackedInt32):
    kind = "gptq"
    methods = ("gptq",)

    def recognise(self, c: Recognition, cfg: QuantConfig) -> QuantSpec | None:
        got = recognise_packed(c, cfg)
        if got is None:
            return None
        q, qweight, module, groups = got
        per = 32 // cfg.bits
        c.add(primary_name(c.local, q), qweight, (c.inp // per, c.out), ("I32",), "qweight (packed along in)")
        g_idx = c.get(module + ".g_idx")
        if g_idx is not None:
            c.add(part_name(c.local, "g_idx"), g_idx, (c.inp,), ("I32", "I64"), "g_idx")
        elif cfg.desc_act:
            c.need(module + ".g_idx", "g_idx (desc_act=true)", qweight)
        zeros_and_scales(c, module, qweight, groups, per)
        return q

    def parts(self, q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        per, groups = 32 // q.bits, ceil_div(q.inp, q.group)
        return {"q": ((q.inp // per, q.out), "I32"), "zero": ((groups, q.out // per), "I32"),
                "scale": ((groups, q.out), scale_dtype or self.scale_dtype), "g_idx": ((q.inp,), "I32")}

    def cpu_path(self, q: QuantSpec, gguf_native: bool = False) -> str | None:
        if q.bits == 4 and self.int4_group(q) is not None:
            return "cpu_int4"
        return "cpu_int8" if q.bits == 8 and not q.float_values and q.group == q.inp else None

    def int4_parts(self, q: QuantSpec, parts: Parts):
        if q.bits != 4 or not in_order(parts.get("g_idx"), q):
            return None
        u = unpack_int32(parts["data"], 4, dim=0).t()
        z = unpack_int32(parts["zero"], 4, dim=1) + q.zero_offset
        scale = parts["scale"].to(F32).t()  # [G, N] -> [N, G]
        return pair_bytes(u.to(torch.uint8)), scale, (8 - z).to(F32).t() * scale, span(q)

    def int8_parts(self, q: QuantSpec, parts: Parts):
        if q.group != q.inp or not in_order(parts.get("g_idx"), q):
            return None
        u = unpack_int32(parts["data"], 8, dim=0).t()  # [N, K] in 0..255
        w = (u - 128).to(torch.int8).contiguous()
        return w, (unpack_int32(parts["zero"], 8, dim=1) + q.zero_offset).reshape(q.out) - 128

    def dequantize(self, q: QuantSpec, parts: Parts, dtype: torch.dtype | None) -> torch.Tensor:
        data, scale = parts["data"], parts["scale"]
        return dequantize_gptq(data, parts.get("zero"), scale, parts.get("g_idx"), q, compute_dtype(scale, dtype))


def zeros_and_scales(c: Recognition, module: str, qweight, groups: int, per: int) -> None:
    """qzeros [G, out/p] and scales [G, out]: GPTQ's and AWQ's alike."""
    c.add(part_name(c.local, "zero"), c.need(module + ".qzeros", "qzeros", qweight), (groups, c.out // per),
          ("I32",), "qzeros")
    c.add(part_name(c.local, "scale"), c.need(module + ".scales", "scales", qweight), (groups, c.out), FLOATS,
          "scales")


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    q: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    values = unpack_int32(qweight, q.bits, dim=0)  # [in, out]
    zeros = unpack_int32(qzeros, q.bits, dim=1) + q.zero_offset  # [G, out]
    groups = group_rows(g_idx, q, qweight.device)
    wt = (values - zeros[groups]).to(F32) * scales.to(F32)[groups]
    return wt.t().to(dtype)


FORMAT = Gptq()
