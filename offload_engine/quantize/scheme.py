"""How one linear weight [out, in] is stored in compressed-tensors' formats, and the math that makes the stored
tensors from its rows. Pure torch: the `compressed-tensors` library is the test suite's reference
(tests/test_quantize.py checks these bytes equal its compressors'), not a dependency of the engine.

  int   pack-quantized: `weight_packed` int32 [out, ceil(in * bits / 32)] (value + 2^(bits-1), element i at bit
        i * bits of the row), `weight_scale` [out, in / group] (group) or [out, 1] (channel), `weight_shape` int64 [2]
  float float-quantized fp8 e4m3: `weight` float8_e4m3fn [out, in], `weight_scale` [out, 1] (channel) or
        [ceil(out / b), ceil(in / b)] (block b x b)

Symmetric round-to-nearest: scale = max|w| / qmax over the group (channel, block), stored in the scale dtype, and
the values computed with the stored scale (so dequantizing reproduces exactly what was rounded).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32",
                      torch.int64: "I64", torch.float8_e4m3fn: "F8_E4M3"}


@dataclass(frozen=True)
class WeightScheme:
    """kind "int" (4 or 8 bits) or "float" (fp8); strategy "group" (int), "channel", or "block" (fp8)."""

    kind: str
    bits: int
    strategy: str
    group: int = 0  # group strategy: input features per scale
    block: int = 0  # block strategy: the b of b x b blocks

    def config_weights(self) -> dict:
        """The scheme's `weights` entry of a compressed-tensors config group."""
        out = {"num_bits": self.bits, "type": self.kind, "symmetric": True, "strategy": self.strategy,
               "dynamic": False}
        if self.strategy == "group":
            out["group_size"] = self.group
        if self.strategy == "block":
            out["block_structure"] = [self.block, self.block]
        return out

    @property
    def format(self) -> str:
        return "float-quantized" if self.kind == "float" else "pack-quantized"

    @property
    def row_multiple(self) -> int:
        """Rows computed together: a block's height for the block strategy, else any number."""
        return self.block if self.strategy == "block" else 1


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def stored_tensors(name: str, shape: tuple[int, ...], s: WeightScheme, scale_dtype: torch.dtype
                   ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The tensors (name, dtype, shape) that store weight `name` [out, in] (or fused experts [E, out, in]: each
    part gets the leading E): `x.weight` -> `x.weight_packed`, `x.weight_scale`, ... as compressed-tensors names
    them."""
    *lead, out, inp = shape
    lead = tuple(lead)
    if s.strategy == "group":
        scale = (out, inp // s.group)
    elif s.strategy == "block":
        scale = (_ceil(out, s.block), _ceil(inp, s.block))
    else:
        scale = (out, 1)
    if s.kind == "float":
        return [(name, torch.float8_e4m3fn, lead + (out, inp)), (name + "_scale", scale_dtype, lead + scale)]
    return [(name + "_packed", torch.int32, lead + (out, _ceil(inp * s.bits, 32))),
            (name + "_scale", scale_dtype, lead + scale), (name + "_shape", torch.int64, lead + (2,))]


def quantize_rows(w: torch.Tensor, s: WeightScheme, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [r, in] of a weight (r a multiple of `row_multiple` unless they are the last) -> (stored values, scale
    rows): int32 packed words or fp8 values, and the scale rows these rows own. One fp32 copy of the rows at a
    time (the rest in place): convert.WORK_BYTES_PER_VALUE is charged for it."""
    w = w.float()
    qmax = FP8_MAX if s.kind == "float" else float((1 << (s.bits - 1)) - 1)
    rows, inp = w.shape
    if s.strategy == "block":
        b = s.block
        padded = w.new_zeros(_ceil(rows, b) * b, _ceil(inp, b) * b)
        padded[:rows, :inp] = w
        grid = padded.view(padded.shape[0] // b, b, padded.shape[1] // b, b)
        scale = _stored_scale(grid.abs().amax(dim=(1, 3)) / qmax, scale_dtype)
        scaled = grid.div_(scale.float()[:, None, :, None]).view(padded.shape)[:rows, :inp]
    else:
        per = s.group if s.strategy == "group" else inp
        groups = w.view(rows, inp // per, per)
        scale = _stored_scale(groups.abs().amax(-1) / qmax, scale_dtype)
        scaled = (groups / scale.float()[..., None]).view(rows, inp)
    if s.kind == "float":
        return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    return pack_int32(scaled.round_().clamp_(-qmax - 1, qmax).to(torch.int8), s.bits), scale


def _stored_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale as stored; an all-zero group (scale 0) gets 1, so its values are 0 rather than 0/0."""
    stored = scale.to(dtype)
    return torch.where(stored == 0, torch.ones_like(stored), stored)


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 values [r, c] in [-2^(bits-1), 2^(bits-1)) -> int32 [r, ceil(c * bits / 32)]: each value plus
    2^(bits-1), element i at bits i * bits .. of the row's bit string (little-endian words, zero padded)."""
    per = 32 // bits
    rows, cols = q.shape
    u = q.to(torch.int32)
    u += 1 << (bits - 1)
    pad = _ceil(cols, per) * per - cols
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.view(rows, -1, per)
    words = torch.zeros(u.shape[:2], dtype=torch.int64)
    for i in range(per):  # field by field: no int64 copy of every value
        words |= u[:, :, i].to(torch.int64) << (i * bits)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def shape_tensor(shape: tuple[int, int]) -> torch.Tensor:
    return torch.tensor(shape, dtype=torch.int64)
