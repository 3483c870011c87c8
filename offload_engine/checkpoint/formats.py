"""Weight formats per tensor: which linear weights a checkpoint stores quantized, and the tensors that make them.

`quantize_schema` rewrites a ModelSchema so each quantized weight is replaced, inside the same unit, by its
component tensors (quantized data, scales, zeros, g_idx, shape): the unit stays one contiguous blob of the bytes
on disk, moved as-is by the store. Only the runtime's linear op (runtime/linear.py) turns them back into math.

Component local names carry the weight's `QuantSpec`: the quantized data is `<local>@q:<tag>` and the others
`<local>@scale`, `@zero`, `@g_idx`, `@shape`, so a unit's tensors describe themselves wherever they are handed.
Every check here reads headers only; what only the data can say (GPTQ g_idx in range, CT weight_shape values)
is checked when the weight is first dequantized, naming the same file and tensor.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import torch

from ..errors import CheckpointFormatError
from .index import TensorRecord
from .naming import ModelSchema, TensorSpec
from .quant_config import CTScheme, QuantConfig

MARK, PRIMARY = "@", "@q:"
PARTS = ("scale", "zero", "g_idx", "shape")
FLOATS = ("F32", "BF16", "F16")
F8 = ("F8_E4M3",)


@dataclass(frozen=True)
class QuantSpec:
    """How one weight [out, in] is stored. kind: fp8_block | ct_pack | ct_naive | gptq | awq | mxfp4 | gguf |
    gguf_kvb (checkpoint/gguf/formats.py)."""

    kind: str
    out: int
    inp: int
    bits: int = 8
    strategy: str = "group"  # group | channel | block | tensor
    group: int = 0  # input features per scale (group strategy, gptq/awq; 0: one group over all inputs)
    block: tuple[int, int] = (0, 0)  # fp8 block / CT block strategy
    symmetric: bool = True
    float_values: bool = False  # CT float-quantized (fp8 values)
    zero_offset: int = 0  # gptq v1 stores zero - 1
    gtype: str = ""  # gguf: the GGUF tensor type of the data (F32, Q4_K, ...)
    gtype2: str = ""  # gguf_kvb: the type of the second part (v_b)
    heads: int = 0  # gguf: rows permuted by llama.cpp's rope permutation over this many heads (0: none)

    @property
    def tag(self) -> str:
        return encode(self)


def encode(q: QuantSpec) -> str:
    return ",".join(f"{f.name}={_text(getattr(q, f.name))}" for f in dataclasses.fields(q))


def _text(v) -> str:
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(int(v) if isinstance(v, bool) else v)


@lru_cache(maxsize=4096)
def decode(tag: str) -> QuantSpec:
    fields = {f.name: f for f in dataclasses.fields(QuantSpec)}
    kw = {}
    for item in tag.split(","):
        name, value = item.split("=", 1)
        default = fields[name].default
        if isinstance(default, bool):
            kw[name] = value == "1"
        elif isinstance(default, tuple):
            kw[name] = tuple(int(x) for x in value.split("x"))
        elif name in ("kind", "strategy", "gtype", "gtype2"):
            kw[name] = value
        else:
            kw[name] = int(value)
    return QuantSpec(**kw)


def primary_name(local: str, q: QuantSpec) -> str:
    return f"{local}{PRIMARY}{q.tag}"


def part_name(local: str, part: str) -> str:
    return f"{local}{MARK}{part}"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _Ctx:
    """One weight being recognised: its logical spec, and helpers that fetch and check component headers."""

    def __init__(self, local: str, spec: TensorSpec, tensors: Mapping[str, TensorRecord]):
        self.local, self.spec, self.tensors = local, spec, tensors
        self.out, self.inp = spec.shape
        self.parts: dict[str, TensorSpec] = {}

    def get(self, name: str) -> TensorRecord | None:
        return self.tensors.get(name)

    def need(self, name: str, what: str, beside: TensorRecord) -> TensorRecord:
        rec = self.tensors.get(name)
        if rec is None:
            raise CheckpointFormatError(beside.file, f"{what} tensor '{name}' missing for quantized weight "
                                                     f"'{beside.name}'", tensor=name)
        return rec

    def add(self, local: str, rec: TensorRecord, shape: tuple[int, ...], dtypes: tuple[str, ...], what: str) -> None:
        """Component `rec` must have `shape` (per expert for fused [E, ...] tensors) and one of `dtypes`."""
        index = self.spec.index
        got = tuple(rec.shape)
        if index is not None:
            if len(got) != len(shape) + 1 or got[0] <= index:
                raise CheckpointFormatError(rec.file, f"{what} of shape {list(got)} does not hold expert {index} "
                                                      f"of shape {list(shape)}", tensor=rec.name)
            got = got[1:]
        if got != tuple(shape):
            raise CheckpointFormatError(rec.file, f"{what} has shape {list(rec.shape)}, expected "
                                                  f"{'[E, ' if index is not None else '['}"
                                                  f"{', '.join(map(str, shape))}] for a [{self.out}, {self.inp}] "
                                                  f"weight", tensor=rec.name)
        if rec.dtype not in dtypes:
            raise CheckpointFormatError(rec.file, f"{what} has dtype {rec.dtype}, expected one of "
                                                  f"{', '.join(dtypes)}", tensor=rec.name)
        self.parts[local] = TensorSpec(rec.name, tuple(shape), index=index, dtype=rec.dtype)


def _fp8_block(c: _Ctx, cfg: QuantConfig) -> QuantSpec | None:
    rec = c.get(c.spec.hf_name)
    if rec is None or rec.dtype not in F8:
        return None  # kept in bf16 (norms, router, modules_to_not_convert) or missing (reported elsewhere)
    b0, b1 = cfg.block
    q = QuantSpec("fp8_block", c.out, c.inp, strategy="block", block=(b0, b1))
    scale = c.need(c.spec.hf_name + "_scale_inv", "scale", rec)
    c.add(primary_name(c.local, q), rec, (c.out, c.inp), F8, "fp8 weight")
    c.add(part_name(c.local, "scale"), scale, (_ceil(c.out, b0), _ceil(c.inp, b1)), FLOATS,
          f"weight_scale_inv (blocks of {b0}x{b1})")
    return q


def _ct_scale_shape(c: _Ctx, s: CTScheme, rec: TensorRecord) -> tuple[int, ...]:
    if s.strategy == "group":
        if c.inp % s.group_size:
            raise CheckpointFormatError(rec.file, f"group_size {s.group_size} (config_groups.{s.name}) does not "
                                                  f"divide in_features {c.inp}", tensor=rec.name)
        return c.out, c.inp // s.group_size
    if s.strategy == "channel":
        return c.out, 1
    if s.strategy == "block":
        return _ceil(c.out, s.block[0]), _ceil(c.inp, s.block[1])
    return (1,)


def _compressed_tensors(c: _Ctx, cfg: QuantConfig) -> QuantSpec | None:
    hf = c.spec.hf_name
    packed, plain, scale = c.get(hf + "_packed"), c.get(hf), c.get(hf + "_scale")
    if packed is None and (plain is None or (scale is None and plain.dtype in FLOATS)):
        return None  # an ignored module kept as it was, or missing (reported elsewhere)
    beside = packed or plain
    module = hf.removesuffix(".weight")
    s = cfg.scheme_for(module)
    if s is None:
        raise CheckpointFormatError(beside.file, f"stored quantized but no config_groups entry of "
                                                 f"quantization_config targets module '{module}' (or it is ignored)",
                                    tensor=beside.name)
    want = "pack-quantized" if packed is not None else ("int-quantized", "float-quantized", "naive-quantized")
    if (packed is not None) != (s.format == "pack-quantized"):
        raise CheckpointFormatError(beside.file, f"tensors are stored as {want} but config_groups.{s.name} says "
                                                 f"format {s.format!r}", tensor=beside.name)
    if s.strategy == "block" and packed is not None:
        raise CheckpointFormatError(beside.file, "pack-quantized weights with the block strategy are not supported",
                                    tensor=beside.name)
    scale = c.need(hf + "_scale", "weight_scale", beside)
    q = QuantSpec("ct_pack" if packed is not None else "ct_naive", c.out, c.inp, bits=s.num_bits,
                  strategy=s.strategy, group=s.group_size or 0, block=s.block or (0, 0), symmetric=s.symmetric,
                  float_values=s.type == "float")
    scale_shape = _ct_scale_shape(c, s, beside)
    if packed is not None:
        c.add(primary_name(c.local, q), packed, (c.out, _ceil(c.inp * s.num_bits, 32)), ("I32",),
              f"weight_packed ({s.num_bits}-bit values of a [{c.out}, {c.inp}] weight)")
        c.add(part_name(c.local, "shape"), c.need(hf + "_shape", "weight_shape", beside), (2,), ("I64", "I32"),
              "weight_shape")
    else:
        c.add(primary_name(c.local, q), plain, (c.out, c.inp), F8 if s.type == "float" else ("I8",),
              "quantized weight")
    c.add(part_name(c.local, "scale"), scale, scale_shape, FLOATS, f"weight_scale ({s.strategy} strategy)")
    if not s.symmetric:
        zero = c.need(hf + "_zero_point", "weight_zero_point", beside)
        if packed is not None:  # packed along the output dimension
            c.add(part_name(c.local, "zero"), zero, (_ceil(scale_shape[0] * s.num_bits, 32), scale_shape[1]),
                  ("I32",), "packed weight_zero_point")
        else:
            c.add(part_name(c.local, "zero"), zero, scale_shape, ("I8", "I32"), "weight_zero_point")
    return q


def _gptq_awq(c: _Ctx, cfg: QuantConfig) -> QuantSpec | None:
    module = c.spec.hf_name.removesuffix(".weight")
    qweight = c.get(module + ".qweight")
    if qweight is None:
        return None
    per = 32 // cfg.bits
    group = c.inp if cfg.group_size == -1 else cfg.group_size
    if c.inp % group or c.inp % per or c.out % per:
        raise CheckpointFormatError(qweight.file, f"group_size {cfg.group_size} and {cfg.bits}-bit packing do not "
                                                  f"divide the [{c.out}, {c.inp}] weight", tensor=qweight.name)
    groups = c.inp // group
    q = QuantSpec(cfg.method, c.out, c.inp, bits=cfg.bits, group=group, symmetric=cfg.sym,
                  zero_offset=cfg.zero_offset)
    if cfg.method == "gptq":
        c.add(primary_name(c.local, q), qweight, (c.inp // per, c.out), ("I32",), "qweight (packed along in)")
        g_idx = c.get(module + ".g_idx")
        if g_idx is not None:
            c.add(part_name(c.local, "g_idx"), g_idx, (c.inp,), ("I32", "I64"), "g_idx")
        elif cfg.desc_act:
            c.need(module + ".g_idx", "g_idx (desc_act=true)", qweight)
    else:
        c.add(primary_name(c.local, q), qweight, (c.inp, c.out // per), ("I32",), "qweight (AWQ GEMM layout)")
    c.add(part_name(c.local, "zero"), c.need(module + ".qzeros", "qzeros", qweight), (groups, c.out // per),
          ("I32",), "qzeros")
    c.add(part_name(c.local, "scale"), c.need(module + ".scales", "scales", qweight), (groups, c.out), FLOATS,
          "scales")
    return q


def _mxfp4(c: _Ctx, cfg: QuantConfig) -> QuantSpec | None:
    blocks = c.get(c.spec.hf_name + "_blocks")
    if blocks is None:
        return None
    if c.inp % 32:
        raise CheckpointFormatError(blocks.file, f"in_features {c.inp} is not a multiple of the 32-value MXFP4 "
                                                 f"block", tensor=blocks.name)
    q = QuantSpec("mxfp4", c.out, c.inp, bits=4, group=32)
    c.add(primary_name(c.local, q), blocks, (c.out, c.inp // 32, 16), ("U8",), "MXFP4 blocks")
    c.add(part_name(c.local, "scale"), c.need(c.spec.hf_name + "_scales", "scales", blocks), (c.out, c.inp // 32),
          ("U8",), "MXFP4 scales (e8m0)")
    return q


_RECOGNISERS = {"fp8": _fp8_block, "compressed-tensors": _compressed_tensors, "gptq": _gptq_awq, "awq": _gptq_awq,
                "mxfp4": _mxfp4}


@dataclass(frozen=True, eq=False)
class WeightFormats:
    """A checkpoint's quantization config with its tensor headers: what an architecture's extra schemas (MTP
    layers) need to be quantized like the main one (DecoderArgs.formats)."""

    config: QuantConfig
    tensors: Mapping[str, TensorRecord]

    def apply(self, schema: ModelSchema) -> ModelSchema:
        return quantize_schema(schema, self.config, self.tensors)[0]


def is_linear_weight(spec: TensorSpec) -> bool:
    """A matrix a linear op multiplies by: 2-D (or one expert's slice of a fused tensor), not an embedding."""
    return len(spec.shape) == 2 and "embed_tokens" not in spec.hf_name and (
        spec.index is not None or spec.hf_name.endswith(".weight"))


def quantize_schema(schema: ModelSchema, cfg: QuantConfig | None, tensors: Mapping[str, TensorRecord]
                    ) -> tuple[ModelSchema, dict[str, QuantSpec]]:
    """The schema with each quantized weight replaced by its components, and hf name -> QuantSpec of those."""
    if cfg is None:
        return schema, {}
    recognise = _RECOGNISERS[cfg.method]
    found: dict[str, QuantSpec] = {}
    units = {}
    for key, specs in schema.units.items():
        out: dict[str, TensorSpec] = {}
        for local, spec in specs.items():
            q = None
            if is_linear_weight(spec):
                c = _Ctx(local, spec, tensors)
                q = recognise(c, cfg)
            if q is None:
                out[local] = spec
            else:
                out.update(c.parts)
                found[spec.hf_name] = q
        units[key] = out
    return dataclasses.replace(schema, units=units), found


def format_summary(found: Mapping[str, QuantSpec]) -> str:
    """e.g. 'fp8_block 128x128 (94 weights)' for inspect-style output."""
    kinds: dict[str, int] = {}
    for q in found.values():
        label = (f"gguf {q.gtype}" if q.kind.startswith("gguf")
                 else q.kind + (f" {q.bits}-bit" if q.kind not in ("fp8_block", "mxfp4") else ""))
        kinds[label] = kinds.get(label, 0) + 1
    return ", ".join(f"{k} ({n} weights)" for k, n in sorted(kinds.items())) or "none"


def keeps_stored_dtype(local: str) -> bool:
    """A quantized weight's data, scales and zeros stay as stored in every tier (the store casts plain floating
    tensors to the compute dtype; fp8 data or fp32 scales cast to bf16 would grow or lose precision)."""
    return MARK in local


def needs_data_check(local: str) -> bool:
    return local.endswith((MARK + "g_idx", MARK + "shape"))


def spec_of(local_part: str, views: Mapping[str, object]) -> QuantSpec:
    """The QuantSpec of the weight a component `<local>@<part>` belongs to (from its primary's name)."""
    prefix = local_part.rsplit(MARK, 1)[0] + PRIMARY
    return decode(next(k for k in views if k.startswith(prefix))[len(prefix):])


def check_component_data(slices, views: Mapping[str, "torch.Tensor"]) -> None:
    """GPTQ g_idx within [0, groups) and compressed-tensors weight_shape equal to the weight's shape: data, so
    checked on a unit's views where it lands (UnitLayout.views), naming the file and tensor."""
    for s in slices:
        q, t = spec_of(s.local, views), views[s.local]
        if s.local.endswith(MARK + "g_idx"):
            groups = q.inp // q.group
            lo, hi = (int(v) for v in torch.aminmax(t.to(torch.int64)))
            if lo < 0 or hi >= groups:
                raise CheckpointFormatError(s.file, f"g_idx holds group {lo if lo < 0 else hi}, outside [0, {groups})"
                                                    f" for {q.inp} inputs in groups of {q.group}", tensor=s.tensor)
        elif [int(v) for v in t.tolist()] != [q.out, q.inp]:
            raise CheckpointFormatError(s.file, f"weight_shape holds {t.tolist()}, expected [{q.out}, {q.inp}]",
                                        tensor=s.tensor)
