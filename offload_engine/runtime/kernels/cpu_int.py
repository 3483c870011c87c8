"""CPU weight-only integer matmuls (torch 2.13): a quantized weight repacked once into what the kernel reads.

  int8   torch._weight_int8pack_mm(x [M, K], q int8 [N, K], s [N]) = x @ (q * s[:, None]).T
         x, s in the compute dtype (float32 / bfloat16 / float16); one scale per output channel only
  int4   torch._convert_weight_to_int4pack_for_cpu(q int32 [N, K] in 0..15, 1) -> uint8 [N, K/2] (same bytes as
         the file's nibbles), then torch._weight_int4pack_mm_for_cpu(x, packed, g, sz [K/g, N, 2]) =
         x @ W.T with W[n, k] = (q[n, k] - 8) * sz[k // g, n, 0] + sz[k // g, n, 1]
         g in {32, 64, 128, 256}; N a multiple of 16; K a multiple of g (measured on torch 2.13: other values
         raise)

Every mapping below (each format's WeightFormat.int4_parts / int8_parts, formats/) is exact algebra on the
format's definition, so the results differ from dequantize-then-matmul only by float rounding (the kernels'
accumulation order, and the bf16/fp16 rounding of scales x zeros where the compute dtype is one of those):

  compressed-tensors pack-quantized int4 (group / channel)   q = stored nibble (value + 8)
      symmetric: sz = (s, 0); asymmetric with zero point z: sz = (s, -z * s)
  GPTQ 4-bit (g_idx absent or i // group), AWQ 4-bit        W = (u - z) * s = (u - 8) * s + (8 - z) * s
  int8 per channel: compressed-tensors pack-quantized (u - 128) and int-quantized (int8 as stored), GPTQ 8-bit
      with one group: y = int8mm(x, q, s) - sum(x) * (z * s)  where the format has a zero point z

Groups a kernel cannot take (int8 groups, int4 groups under 32, GPTQ act-order) return None: the caller
dequantizes.
"""
from __future__ import annotations

import functools
import sys

import torch

from ...checkpoint.formats import QuantSpec
from ...formats.gptq import in_order  # noqa: F401
from ...formats.packing import pair_bytes  # noqa: F401
from ...formats.registry import format_of

F32 = torch.float32


def available() -> bool:
    return (sys.byteorder == "little" and hasattr(torch, "_weight_int8pack_mm")
            and hasattr(torch, "_weight_int4pack_mm_for_cpu"))


def scales_and_zeros(scale: torch.Tensor, zero_term: torch.Tensor | None, group: int, kgroup: int,
        dtype: torch.dtype) -> torch.Tensor:
    """[N, G] scales (and additive terms) per format group -> [K/kgroup, N, 2] in the compute dtype."""
    rep = group // kgroup
    s = scale.to(F32).repeat_interleave(rep, dim=1)
    z = torch.zeros_like(s) if zero_term is None else zero_term.to(F32).repeat_interleave(rep, dim=1)
    return torch.stack((s.t(), z.t()), dim=-1).to(dtype).contiguous()


def repack_int4(q: QuantSpec, parts: dict[str, torch.Tensor | None], dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed uint8 [N, K/2], sz [K/g, N, 2]) for a 4-bit weight, or None where the kernel does not apply.
    parts: data, scale, zero (None if absent), g_idx (None if absent); the weight's format maps its own
    (WeightFormat.int4_parts)."""
    fmt = format_of(q)
    kg = fmt.int4_group(q)
    got = fmt.int4_parts(q, parts) if kg is not None else None
    if got is None:
        return None
    packed_bytes, scale, term, group = got
    return int4_pack_bytes(packed_bytes), scales_and_zeros(scale, term, group, kg, dtype)


@functools.cache
def int4_block_rows() -> int:
    """Rows per block of torch's CPU int4 pack on this machine: 64 where its kernel runs AVX-512, 32 with AVX2 (or
    without either). Probed once with torch's own converter, the layout's one authority."""
    q = torch.randint(0, 16, (64, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    for rows in (64, 32):
        if torch.equal(int4_nibbles(packed, 64, 64, rows).to(torch.int32), q):
            return rows
    raise RuntimeError("torch's CPU int4 pack has a layout this engine does not know (torch "
                       f"{torch.__version__}): expected blocks of 64 or 32 rows")


def int4_pack_bytes(b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """torch._convert_weight_to_int4pack_for_cpu(q, 1) from q's bytes b (uint8 [N, K/2], value 2j low and 2j + 1
    high: compressed-tensors' words as they lie), bit for bit, in uint8 arithmetic without unpacking (several
    times faster than torch's, which takes int32 [N, K]: a unit is repacked each time a read lands it).
    Layout (int4_nibbles reads it back): rows in blocks of B = int4_block_rows(), byte (k, i) of a block = rows
    i | i + B/2 << 4; the last N % B rows as byte (k, j) = rows 2j | 2j + 1 << 4."""
    n, half = b.shape
    rows = block or int4_block_rows()
    full = n // rows * rows

    def merged(lo_rows: torch.Tensor, hi_rows: torch.Tensor) -> torch.Tensor:
        """The even inputs' bytes, then the odd inputs' (low nibble from lo_rows, high from hi_rows)."""
        return torch.stack(((lo_rows & 15) | (hi_rows << 4), (lo_rows >> 4) | (hi_rows & 0xF0)))

    blocks = b[:full].view(n // rows, 2, rows // 2, half)
    head = merged(blocks[:, 0], blocks[:, 1]).permute(1, 3, 0, 2).contiguous()  # [N/B, K/2, 2, B/2]
    if full == n:
        return head.view(n, half)
    pairs = b[full:].view((n - full) // 2, 2, half)
    tail = merged(pairs[:, 0], pairs[:, 1]).permute(2, 0, 1).contiguous()  # [K/2, 2, (N - full) / 2]
    return torch.cat((head.view(-1), tail.view(-1))).view(n, half)


def repack_int8(q: QuantSpec, parts: dict[str, torch.Tensor | None], dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(int8 [N, K], scale [N], zero term [N] or None) for an 8-bit per-channel weight, or None (the weight's
    format maps its own: WeightFormat.int8_parts)."""
    if q.bits != 8 or q.float_values:
        return None
    got = format_of(q).int8_parts(q, parts)
    if got is None:
        return None
    w, z = got
    s = parts["scale"].to(F32).reshape(q.out)
    term = None if z is None else (z.to(F32) * s).to(dtype)
    return w, s.to(dtype).contiguous(), term


def int4_mm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, k).contiguous(), packed, k // sz.shape[0], sz)
    return y.reshape(*lead, -1)


def int8_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, term: torch.Tensor | None) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    y = torch._weight_int8pack_mm(x2, w, s)
    if term is not None:  # W = (q - z) * s: subtract sum_k x[m, k] * z[n] * s[n]
        y = y - x2.sum(-1, keepdim=True, dtype=F32).to(y.dtype) * term
    return y.reshape(*lead, -1)


def int4_nibbles(packed: torch.Tensor, n: int, k: int, block: int | None = None) -> torch.Tensor:
    """The [N, K] values (0..15) of torch's CPU int4 pack: rows in blocks of B (int4_block_rows()), byte (k, i) of
    a block holding rows i (low nibble) and i + B/2 (high); the last N % B rows as byte (k, j) = rows 2j (low),
    2j + 1 (high)."""
    rows = block or int4_block_rows()
    b = packed.reshape(-1)
    full = n // rows * rows
    blk = b[:full * k // 2].view(n // rows, k, rows // 2)
    head = torch.cat((blk & 15, blk >> 4), dim=2).permute(0, 2, 1).reshape(full, k)
    rest = b[full * k // 2:].view(k, (n - full) // 2)
    tail = torch.stack((rest & 15, rest >> 4), dim=2).reshape(k, n - full).t()
    return torch.cat((head, tail))


def int4_dense(packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The weight the int4 kernel multiplies by, [N, K] in float32: (q - 8) * scale + zero per group."""
    groups, n = sz.shape[0], sz.shape[1]
    k = packed.numel() * 2 // n
    q = int4_nibbles(packed, n, k).to(F32) - 8
    s, z = (sz[..., i].t().to(F32).repeat_interleave(k // groups, dim=1) for i in (0, 1))
    return q * s + z


def int8_dense(w: torch.Tensor, s: torch.Tensor, term: torch.Tensor | None) -> torch.Tensor:
    """The weight the int8 kernel multiplies by, [N, K] in float32: q * s (less the zero term z * s)."""
    out = w.to(F32) * s.to(F32)[:, None]
    return out if term is None else out - term.to(F32)[:, None]
