"""compressed-tensors (quant_method "compressed-tensors"): pack-quantized (ct_pack: int values packed in int32
words, `weight_packed` + `weight_shape`) and int- / float-quantized (ct_naive: int8 or fp8 e4m3 values as
stored), each with `weight_scale` (and `weight_zero_point` when asymmetric) per channel / group / block / tensor:
  ct_pack   q = packed value - 2^(bits-1) (element i at bits i*b of its row's int32 words, little end first);
            W = (q - zero) * scale                                  zero points packed along the output dimension
  ct_naive  W = (q - zero) * scale, q int8 or fp8
CPU kernel forms: int4 group/channel (the words' bytes are the kernel's nibbles), int8 per channel; fp8 values
take the dense form. CUDA: the triton kernel reads pack-quantized words; fp8 channel/128-blocks take _scaled_mm."""
from __future__ import annotations

import torch

from ..checkpoint.quant_config import CTScheme, QuantConfig
from ..errors import CheckpointFormatError
from .base import Parts, WeightFormat
from .packing import F32, expand, float32_of, unpack_int32
from .spec import F8, FLOATS, QuantSpec, Recognition, ceil_div, compute_dtype, part_name, primary_name


def scale_shape(q: QuantSpec) -> tuple[int, ...]:
    if q.strategy == "group":
        return q.out, ceil_div(q.inp, q.group)
    if q.strategy == "channel":
        return q.out, 1
    if q.strategy == "block":
        return ceil_div(q.out, q.block[0]), ceil_div(q.inp, q.block[1])
    return (1,)


def _checked_scale_shape(c: Recognition, s: CTScheme, rec) -> tuple[int, ...]:
    if s.strategy == "group":
        if c.inp % s.group_size:
            raise CheckpointFormatError(rec.file, f"group_size {s.group_size} (config_groups.{s.name}) does not "
                                                  f"divide in_features {c.inp}", tensor=rec.name)
        return c.out, c.inp // s.group_size
    if s.strategy == "channel":
        return c.out, 1
    if s.strategy == "block":
        return ceil_div(c.out, s.block[0]), ceil_div(c.inp, s.block[1])
    return (1,)


def _spec(s: CTScheme, packed: bool, out: int, inp: int) -> QuantSpec:
    return QuantSpec("ct_pack" if packed else "ct_naive", out, inp, bits=s.num_bits, strategy=s.strategy,
                     group=s.group_size or 0, block=s.block or (0, 0), symmetric=s.symmetric,
                     float_values=s.type == "float")


def recognise(c: Recognition, cfg: QuantConfig) -> QuantSpec | None:
    """Either kind: the tensors present (`weight_packed` or a quantized `weight`) say which."""
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
    q = _spec(s, packed is not None, c.out, c.inp)
    shape = _checked_scale_shape(c, s, beside)
    if packed is not None:
        c.add(primary_name(c.local, q), packed, (c.out, ceil_div(c.inp * s.num_bits, 32)), ("I32",),
              f"weight_packed ({s.num_bits}-bit values of a [{c.out}, {c.inp}] weight)")
        c.add(part_name(c.local, "shape"), c.need(hf + "_shape", "weight_shape", beside), (2,), ("I64", "I32"),
              "weight_shape")
    else:
        c.add(primary_name(c.local, q), plain, (c.out, c.inp), F8 if s.type == "float" else ("I8",),
              "quantized weight")
    c.add(part_name(c.local, "scale"), scale, shape, FLOATS, f"weight_scale ({s.strategy} strategy)")
    if not s.symmetric:
        zero = c.need(hf + "_zero_point", "weight_zero_point", beside)
        if packed is not None:  # packed along the output dimension
            c.add(part_name(c.local, "zero"), zero, (ceil_div(shape[0] * s.num_bits, 32), shape[1]),
                  ("I32",), "packed weight_zero_point")
        else:
            c.add(part_name(c.local, "zero"), zero, shape, ("I8", "I32"), "weight_zero_point")
    return q


class _CompressedTensors(WeightFormat):
    methods = ("compressed-tensors",)
    scale_dtype = "BF16"  # the releases' model dtype, as tools/quant_writers.py writes it

    def recognise(self, c: Recognition, cfg: QuantConfig) -> QuantSpec | None:
        return recognise(c, cfg)

    def scale_names(self, hf_name: str) -> tuple[str, ...]:
        return (hf_name + "_scale",)

    def planned(self, cfg: QuantConfig, unit_kind: str, module: str, out: int, inp: int) -> QuantSpec | None:
        s = cfg.scheme_for(module)
        return None if s is None else _spec(s, s.format == "pack-quantized", out, inp)


class CtPack(_CompressedTensors):
    kind = "ct_pack"

    def parts(self, q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        scale = scale_shape(q)
        parts = {"q": ((q.out, ceil_div(q.inp * q.bits, 32)), "I32"),
                 "scale": (scale, scale_dtype or self.scale_dtype), "shape": ((2,), "I64")}
        if not q.symmetric:  # packed along the output dimension
            parts["zero"] = ((ceil_div(scale[0] * q.bits, 32), *scale[1:]), "I32")
        return parts

    def cpu_path(self, q: QuantSpec, gguf_native: bool = False) -> str | None:
        if q.bits == 4 and self.int4_group(q) is not None:
            return "cpu_int4"
        return "cpu_int8" if q.bits == 8 and not q.float_values and q.strategy == "channel" else None

    def int4_parts(self, q: QuantSpec, parts: Parts):
        if q.bits != 4 or q.strategy not in ("group", "channel"):
            return None
        data, scale, zero = parts["data"], parts["scale"], parts.get("zero")
        # the words' bytes, low nibble first (little-endian): the stored values + 8, the kernel's q, in order
        packed_bytes = data.contiguous().view(torch.uint8).view(q.out, -1)[:, :q.inp // 2]
        scale = scale.to(F32).reshape(q.out, -1)
        term = None
        if zero is not None:
            z = (unpack_int32(zero, 4, dim=0)[:scale.shape[0]] - 8).to(F32).reshape(q.out, -1)
            term = -z * scale
        return packed_bytes, scale, term, q.inp if q.strategy == "channel" or q.group == 0 else q.group

    def int8_parts(self, q: QuantSpec, parts: Parts):
        if q.strategy != "channel" or q.inp % 4:
            return None
        # 4 bytes per int32 word, lowest first: on a little-endian machine the words' bytes are the values + 128
        w = (parts["data"].contiguous().view(torch.uint8).view(q.out, q.inp) ^ 0x80).view(torch.int8)
        zero = parts.get("zero")
        return w, None if zero is None else unpack_int32(zero, 8, dim=0)[:q.out].reshape(q.out) - 128

    def triton_int(self, q: QuantSpec) -> bool:
        return q.strategy in ("group", "channel")

    def dequantize(self, q: QuantSpec, parts: Parts, dtype: torch.dtype | None) -> torch.Tensor:
        packed, scale = parts["data"], parts["scale"]
        return dequantize_ct_pack(packed, scale, parts.get("zero"), q, compute_dtype(scale, dtype))


class CtNaive(_CompressedTensors):
    kind = "ct_naive"
    int8_as_stored = True

    def parts(self, q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        scale = scale_shape(q)
        parts = {"q": ((q.out, q.inp), "F8_E4M3" if q.float_values else "I8"),
                 "scale": (scale, scale_dtype or self.scale_dtype)}
        if not q.symmetric:
            parts["zero"] = (scale, "I8")
        return parts

    def cpu_path(self, q: QuantSpec, gguf_native: bool = False) -> str | None:
        if q.float_values:
            return "cpu_dense"
        return "cpu_int8" if q.bits == 8 and q.strategy == "channel" else None

    def int8_parts(self, q: QuantSpec, parts: Parts):
        data = parts["data"]
        if q.strategy != "channel" or data.dtype != torch.int8:
            return None
        zero = parts.get("zero")
        return data, None if zero is None else zero.reshape(q.out)  # int-quantized: the stored matrix, no copy

    def fp8_scaling(self, q: QuantSpec) -> str | None:
        if not q.float_values or q.strategy not in ("block", "channel"):
            return None
        return q.strategy

    def dequantize(self, q: QuantSpec, parts: Parts, dtype: torch.dtype | None) -> torch.Tensor:
        data, scale = parts["data"], parts["scale"]
        return dequantize_ct_naive(data, scale, parts.get("zero"), q, compute_dtype(scale, dtype))


def dequantize_ct_pack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, q: QuantSpec,
                       dtype: torch.dtype) -> torch.Tensor:
    offset = 1 << (q.bits - 1)
    values = unpack_int32(packed, q.bits, dim=1)[:, :q.inp] - offset
    scale = scale.to(F32)
    x = values.to(F32)
    if zero is not None:  # packed along the output dimension, one row per scale row
        zero = unpack_int32(zero, q.bits, dim=0)[:scale.shape[0]] - offset
        x = x - expand(zero.to(F32), q.out, q.inp, q)
    return (x * expand(scale, q.out, q.inp, q)).to(dtype)


def dequantize_ct_naive(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, q: QuantSpec,
                        dtype: torch.dtype) -> torch.Tensor:
    x = float32_of(weight)
    if zero is not None:
        x = x - expand(zero.to(F32), q.out, q.inp, q)
    return (x * expand(scale.to(F32), q.out, q.inp, q)).to(dtype)


CT_PACK, CT_NAIVE = CtPack(), CtNaive()
