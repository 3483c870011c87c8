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
from ..formats.registry import FORMATS, for_method, format_of
from ..formats.spec import DTYPE_BYTES  # noqa: F401

FLOAT_BITS = {"F64": 64.0, "F32": 32.0, "BF16": 16.0, "F16": 16.0}
# the scales' dtype where the checkpoint's headers do not say, by format (each format's scale_dtype: fp8 blocks'
# weight_scale_inv float32 as in the releases; compressed-tensors bf16; GPTQ and AWQ fp16; MXFP4 e8m0 bytes)
SCALE_DTYPES = {kind: f.scale_dtype for kind, f in FORMATS.items() if f.scale_dtype}
# kept as stored by the writers and the releases (tools/quant_writers._KEEP, and gpt-oss's router)
_KEEP = re.compile(r"(embed_tokens|lm_head|shared_head\.head|norm|mlp\.gate$|shared_expert_gate$|router|visual\.)")


def quant_spec_for(cfg: QuantConfig, kind: str, ts: TensorSpec) -> QuantSpec | None:
    """The QuantSpec a checkpoint in format `cfg` stores tensor `ts` of a `kind` unit with, or None (kept)."""
    if kind in ("embed", "head") or not is_linear_weight(ts):
        return None
    module = ts.hf_name.removesuffix(".weight")
    if _KEEP.search(module):
        return None
    fmt = for_method(cfg.method)
    return None if fmt is None else fmt.planned(cfg, kind, module, *ts.shape)


def quant_parts(q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """part -> (shape, safetensors dtype) of the tensors that store the weight `q` describes (its format's)."""
    return format_of(q).parts(q, scale_dtype)


def quantized_bytes(q: QuantSpec, scale_dtype: str | None = None) -> int:
    return format_of(q).nbytes(q, scale_dtype)


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
