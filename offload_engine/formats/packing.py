"""Bit-level helpers the formats share: int32 words of packed fields, fp8 bytes as float32, scales broadcast."""
from __future__ import annotations

import torch

from .spec import QuantSpec

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


def expand(scale: torch.Tensor, rows: int, cols: int, q: QuantSpec) -> torch.Tensor:
    """A per-channel / per-group / per-block / per-tensor scale (or zero) broadcast to [rows, cols]."""
    if q.strategy == "tensor":
        return scale.reshape(1, 1).expand(rows, cols)
    if q.strategy == "channel":
        return scale.reshape(rows, 1).expand(rows, cols)
    if q.strategy == "group":
        return scale.repeat_interleave(q.group, dim=1)
    b0, b1 = q.block
    return scale.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]


def pair_bytes(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> [N, K/2] bytes, value k in the low nibble and k + 1 in the high one."""
    return q[:, 0::2] | (q[:, 1::2] << 4)
