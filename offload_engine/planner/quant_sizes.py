"""Bytes of a quantized weight from its QuantSpec: the component tensors checkpoint/formats.py groups into the
weight's unit (data, scales, zeros, g_idx, weight_shape), with the shapes its recognisers check and the dtypes
the releases and tools/quant_writers.py store. Which weights a QuantConfig quantizes follows the writers and the
releases: every linear weight of the decoder and MTP layers except the embedding, the output head, norms and
routers (and what the config itself leaves out: fp8's modules_to_not_convert, compressed-tensors' ignore)."""
from __future__ import annotations

import math
import re

from ..checkpoint.formats import QuantSpec, is_linear_weight
from ..checkpoint.naming import TensorSpec
from ..checkpoint.quant_config import QuantConfig

FLOAT_BITS = {"F64": 64.0, "F32": 32.0, "BF16": 16.0, "F16": 16.0}
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1}
# the scales' dtype where the checkpoint's headers do not say: fp8 blocks' weight_scale_inv is float32 in the
# releases; compressed-tensors bf16 (the releases' model dtype, as tools/quant_writers.py writes it); GPTQ and
# AWQ fp16; MXFP4 e8m0 bytes
SCALE_DTYPES = {"fp8_block": "F32", "ct_pack": "BF16", "ct_naive": "BF16", "gptq": "F16", "awq": "F16", "mxfp4": "U8"}
# kept as stored by the writers and the releases (tools/quant_writers._KEEP, and gpt-oss's router)
_KEEP = re.compile(r"(embed_tokens|lm_head|shared_head\.head|norm|mlp\.gate$|shared_expert_gate$|router|visual\.)")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _listed(module: str, patterns: tuple[str, ...]) -> bool:
    """fp8 modules_to_not_convert: a module name, a prefix of it, or a glob (gpt-oss: 'model.layers.*.self_attn')."""
    import fnmatch

    return any(module == p or module.startswith(p + ".") or fnmatch.fnmatch(module, p)
               or fnmatch.fnmatch(module, p + ".*") for p in patterns)


def quant_spec_for(cfg: QuantConfig, kind: str, ts: TensorSpec) -> QuantSpec | None:
    """The QuantSpec a checkpoint in format `cfg` stores tensor `ts` of a `kind` unit with, or None (kept)."""
    if kind in ("embed", "head") or not is_linear_weight(ts):
        return None
    module = ts.hf_name.removesuffix(".weight")
    if _KEEP.search(module):
        return None
    out, inp = ts.shape
    if cfg.method == "fp8":
        if _listed(module, cfg.not_convert):
            return None
        return QuantSpec("fp8_block", out, inp, strategy="block", block=cfg.block or (128, 128))
    if cfg.method == "compressed-tensors":
        s = cfg.scheme_for(module)
        if s is None:
            return None
        return QuantSpec("ct_pack" if s.format == "pack-quantized" else "ct_naive", out, inp, bits=s.num_bits,
                         strategy=s.strategy, group=s.group_size or 0, block=s.block or (0, 0),
                         symmetric=s.symmetric, float_values=s.type == "float")
    if cfg.method in ("gptq", "awq"):
        return QuantSpec(cfg.method, out, inp, bits=cfg.bits, group=inp if cfg.group_size == -1 else cfg.group_size,
                         symmetric=cfg.sym, zero_offset=cfg.zero_offset)
    if cfg.method == "mxfp4" and kind == "expert":
        return QuantSpec("mxfp4", out, inp, bits=4, group=32)
    return None


def ct_scale_shape(q: QuantSpec) -> tuple[int, ...]:
    if q.strategy == "group":
        return q.out, _ceil(q.inp, q.group)
    if q.strategy == "channel":
        return q.out, 1
    if q.strategy == "block":
        return _ceil(q.out, q.block[0]), _ceil(q.inp, q.block[1])
    return (1,)


def quant_parts(q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """part -> (shape, safetensors dtype) of the tensors that store the weight `q` describes."""
    sd = scale_dtype or SCALE_DTYPES[q.kind]
    o, i = q.out, q.inp
    if q.kind == "fp8_block":
        return {"q": ((o, i), "F8_E4M3"), "scale": ((_ceil(o, q.block[0]), _ceil(i, q.block[1])), sd)}
    if q.kind in ("ct_pack", "ct_naive"):
        scale = ct_scale_shape(q)
        packed = q.kind == "ct_pack"
        parts = {"q": ((o, _ceil(i * q.bits, 32)), "I32") if packed else
                 ((o, i), "F8_E4M3" if q.float_values else "I8"), "scale": (scale, sd)}
        if packed:
            parts["shape"] = ((2,), "I64")
        if not q.symmetric:  # packed: along the output dimension
            parts["zero"] = ((_ceil(scale[0] * q.bits, 32), *scale[1:]), "I32") if packed else (scale, "I8")
        return parts
    if q.kind in ("gptq", "awq"):
        per, groups = 32 // q.bits, _ceil(i, q.group)
        parts = {"q": ((i // per, o), "I32") if q.kind == "gptq" else ((i, o // per), "I32"),
                 "zero": ((groups, o // per), "I32"), "scale": ((groups, o), sd)}
        if q.kind == "gptq":
            parts["g_idx"] = ((i,), "I32")
        return parts
    if q.kind == "mxfp4":
        return {"q": ((o, i // 32, 16), "U8"), "scale": ((o, i // 32), "U8")}
    raise ValueError(f"no byte formula for weight format {q.kind!r}")


def quantized_bytes(q: QuantSpec, scale_dtype: str | None = None) -> int:
    return sum(math.prod(shape) * DTYPE_BYTES[dtype] for shape, dtype in quant_parts(q, scale_dtype).values())


def tensor_bytes(numel: int, bits: float) -> int:
    return math.ceil(numel * bits / 8)


def nominal_bits(cfg: QuantConfig) -> float:
    """Bits per weight of a large [4096, 4096] weight in format `cfg` (routed experts' for MXFP4)."""
    ts = TensorSpec("model.layers.0.mlp.experts.0.up_proj.weight", (4096, 4096))
    q = quant_spec_for(cfg, "expert", ts)
    return round(8 * quantized_bytes(q) / ts.numel, 3) if q is not None else 16.0


def describe(cfg: QuantConfig) -> str:
    """e.g. 'compressed-tensors pack-quantized int4, group 32, symmetric' (plan's weights line, inspect)."""
    if cfg.method == "fp8":
        b = cfg.block or (128, 128)
        return f"fp8 e4m3, {b[0]}x{b[1]} blocks (float32 scales)"
    if cfg.method == "mxfp4":
        return "mxfp4 experts (e2m1, e8m0 scale per 32)"
    if cfg.method in ("gptq", "awq"):
        group = "one group per row" if cfg.group_size == -1 else f"group {cfg.group_size}"
        return f"{cfg.method} int{cfg.bits}, {group}{', act-order' if cfg.desc_act else ''}"
    schemes = []
    for s in cfg.schemes:
        how = {"group": f"group {s.group_size}", "block": f"{(s.block or (0, 0))[0]}x{(s.block or (0, 0))[1]} blocks",
               "channel": "per channel", "tensor": "per tensor"}[s.strategy]
        schemes.append(f"{s.format} {s.type}{s.num_bits}, {how}, {'symmetric' if s.symmetric else 'asymmetric'}")
    return "compressed-tensors " + "; ".join(schemes)
