"""Quantized weights -> dense [out, in] matrices in the compute dtype: vectorised torch, on the weights' device.

Each function follows its format's published definition (see checkpoint/formats.py for the tensors):

  fp8_block   W = q * scale_inv[i // b0, j // b1]                       (DeepSeek-V3 / Kimi K2 / Qwen FP8)
  ct_pack     q = packed value - 2^(bits-1) (element i at bits i*b of its row's int32 words, little end first);
              W = (q - zero) * scale per group / channel / tensor      (compressed-tensors pack-quantized)
  ct_naive    W = (q - zero) * scale, q int8 or fp8, per channel / group / block / tensor
  gptq        qweight [in/p, out] packed along in, qzeros [G, out/p] along out; W[o, i] = (q - (z + offset))
              * s at group g_idx[i] (default i // group)
  awq         qweight [in, out/8] and qzeros, nibble i of each word holding column 8k + [0,2,4,6,1,3,5,7][i];
              W[o, i] = (q - z) * s at group i // group
  mxfp4       two e2m1 values per byte (low nibble first), one e8m0 exponent (bias 127) per 32 values

The arithmetic is done in float32 (exact: small integers times one scale) and rounded once to `dtype`.
"""
from __future__ import annotations

import torch

from ..checkpoint.formats import QuantSpec

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column k of a word lives in nibble AWQ_REVERSE_ORDER[k]
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
F32 = torch.float32


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-bit fields of int32 words, the lowest first, laid out along `dim` (int32 result)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    if dim == 0:
        fields = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask  # [rows, per, cols]
        return fields.reshape(-1, packed.shape[1])
    fields = (packed.unsqueeze(-1) >> shifts) & mask  # [rows, cols, per]
    return fields.reshape(packed.shape[0], -1)


_FP8_LUTS: dict[torch.device, torch.Tensor] = {}


def float32_of(t: torch.Tensor) -> torch.Tensor:
    """t as float32; fp8 e4m3 values through a 256-entry table (exact, NaNs included: the table is torch's own
    conversion of every byte), which on a CPU runs ~4x faster than torch's elementwise conversion."""
    if t.dtype != torch.float8_e4m3fn or t.device.type != "cpu":
        return t.to(F32)
    lut = _FP8_LUTS.get(t.device)
    if lut is None:
        lut = _FP8_LUTS[t.device] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F32)
    return torch.take(lut, t.view(torch.uint8).to(torch.long)).view(t.shape)


def _expand(scale: torch.Tensor, rows: int, cols: int, q: QuantSpec) -> torch.Tensor:
    """A per-channel / per-group / per-block / per-tensor scale (or zero) broadcast to [rows, cols]."""
    if q.strategy == "tensor":
        return scale.reshape(1, 1).expand(rows, cols)
    if q.strategy == "channel":
        return scale.reshape(rows, 1).expand(rows, cols)
    if q.strategy == "group":
        return scale.repeat_interleave(q.group, dim=1)
    b0, b1 = q.block
    return scale.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]


def fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, q: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    b0, b1 = q.block
    if q.strategy == "block" and q.out % b0 == 0 and q.inp % b1 == 0:  # whole blocks: broadcast, no [out, in] scale
        x = float32_of(weight).view(q.out // b0, b0, q.inp // b1, b1)
        return (x * scale_inv.to(F32).view(q.out // b0, 1, q.inp // b1, 1)).view(q.out, q.inp).to(dtype)
    return (float32_of(weight) * _expand(scale_inv.to(F32), q.out, q.inp, q)).to(dtype)


def ct_pack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, q: QuantSpec,
            dtype: torch.dtype) -> torch.Tensor:
    offset = 1 << (q.bits - 1)
    values = unpack_int32(packed, q.bits, dim=1)[:, :q.inp] - offset
    scale = scale.to(F32)
    x = values.to(F32)
    if zero is not None:  # packed along the output dimension, one row per scale row
        zero = unpack_int32(zero, q.bits, dim=0)[:scale.shape[0]] - offset
        x = x - _expand(zero.to(F32), q.out, q.inp, q)
    return (x * _expand(scale, q.out, q.inp, q)).to(dtype)


def ct_naive(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, q: QuantSpec,
             dtype: torch.dtype) -> torch.Tensor:
    x = float32_of(weight)
    if zero is not None:
        x = x - _expand(zero.to(F32), q.out, q.inp, q)
    return (x * _expand(scale.to(F32), q.out, q.inp, q)).to(dtype)


def _group_rows(g_idx: torch.Tensor | None, q: QuantSpec, device: torch.device) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.to(torch.long)
    return torch.arange(q.inp, device=device) // q.group


def gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
         q: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    values = unpack_int32(qweight, q.bits, dim=0)  # [in, out]
    zeros = unpack_int32(qzeros, q.bits, dim=1) + q.zero_offset  # [G, out]
    groups = _group_rows(g_idx, q, qweight.device)
    wt = (values - zeros[groups]).to(F32) * scales.to(F32)[groups]
    return wt.t().to(dtype)


def awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, q: QuantSpec,
        dtype: torch.dtype) -> torch.Tensor:
    order = torch.tensor(AWQ_REVERSE_ORDER, device=qweight.device)

    def columns(packed: torch.Tensor) -> torch.Tensor:  # [rows, out/8] words -> [rows, out] in column order
        fields = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
        return fields.index_select(2, order).reshape(packed.shape[0], -1)

    groups = _group_rows(None, q, qweight.device)
    wt = (columns(qweight) - columns(qzeros)[groups]).to(F32) * scales.to(F32)[groups]
    return wt.t().to(dtype)


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, q: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    lut = torch.tensor(FP4_VALUES, dtype=F32, device=blocks.device)
    pairs = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [out, in/32, 16, 2]
    values = pairs.reshape(q.out, q.inp // 32, 32)
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).reshape(q.out, q.inp).to(dtype)
