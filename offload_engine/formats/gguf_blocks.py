"""GGUF tensor types -> float32, vectorised torch on the weights' device (checkpoint/gguf/ maps the tensors;
formats/gguf.py is the WeightFormat that uses these decoders).

Each block decoder follows ggml's definition, in the operation order of the `gguf` package's own numpy
dequantizer (gguf/quants.py), so the results are bit-identical to it (tests/test_gguf.py):

  Q8_0    34-byte blocks of 32: f16 d, 32 int8;                     x = q * d
  Q4_0    18-byte blocks of 32: f16 d, 16 bytes (low nibbles = 0..15); x = d * (q - 8)
  Q4_K    144-byte super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks,
          128 bytes of nibbles;                                      x = (d * sc) * q - (dmin * m)
  Q5_K    176 bytes: Q4_K's plus 32 bytes of fifth bits
  Q6_K    210 bytes: 128 low nibbles, 64 bytes of 2 high bits, 16 int8 scales, f16 d; x = (d * sc) * (q - 32)
  IQ4_XS  136 bytes: f16 d, u16 high scale bits, 4 bytes of low scale bits, 128 nibbles indexing a
          non-linear 16-value table;                                 x = (d * (ls - 32)) * table[q]
  MXFP4   17-byte blocks of 32: e8m0 exponent e, 16 bytes (low nibbles = 0..15) of e2m1 codes;
          x = 2^(e-128) * (2 * e2m1[q]), e2m1 doubled so the table is integers (gpt-oss experts)

A weight's rows are independent (blocks run along the input dimension), so one expert's slice of a fused
tensor, or the rows of the embedding a lookup needs, decode on their own.
"""
from __future__ import annotations

import torch

from .spec import QuantSpec

F32 = torch.float32
QK_K = 256
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 doubled (gguf.quants.MXFP4)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian bytes -> [n, 1] float32."""
    return raw.contiguous().view(torch.float16).to(F32)


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """[n, groups * width] bytes -> [n, groups, 2, width]: each group's low nibbles, then its high ones."""
    q = qs.reshape(qs.shape[0], groups, 1, width)
    return torch.cat((q & 0x0F, q >> 4), dim=2)


def q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    x = b[:, 2:].contiguous().view(torch.int8).to(F32)
    return x * d


def q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 1, 16).reshape(n, 32).to(torch.int8) - 8
    return d * q.to(F32)


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in a K-quant's 12 bytes (ggml's get_scale_min_k4)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min(b[:, 4:16])
    return (d * sc.to(F32)).reshape(n, 8, 1), (dmin * mn.to(F32)).reshape(n, 8, 1)


def q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_scales(b)
    q = _nibbles(b[:, 16:], 4, 32).reshape(n, 8, 32).to(F32)
    return (d * q - dm).reshape(n, QK_K)


def q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_scales(b)
    qh = b[:, 16:48].reshape(n, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 1, 8, 1)
    ql = _nibbles(b[:, 48:], 4, 32).reshape(n, 8, 32)
    q = (ql | ((qh & 1).reshape(n, 8, 32) << 4)).to(F32)
    return (d * q - dm).reshape(n, QK_K)


def q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(F32)
    d = (_f16(b[:, 208:210]) * scales).reshape(n, QK_K // 16, 1)
    ql = _nibbles(b[:, :128], 2, 64).reshape(n, 8, 32)
    shifts = torch.tensor((0, 2, 4, 6), dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, QK_K // 16, 16).to(F32)).reshape(n, QK_K)


def iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    high = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)
    sh = ((high.view(n, 1) >> shifts) & 3).to(torch.uint8)
    sl = torch.stack((b[:, 4:8] & 0x0F, b[:, 4:8] >> 4), dim=-1).reshape(n, 8)
    ls = (sl | (sh << 4)).to(torch.int8) - 32
    dl = (d * ls.to(F32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:], 8, 16).reshape(n, 8, 32).long()
    table = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=b.device).to(F32)
    return (dl * table[q]).reshape(n, QK_K)


def mxfp4(b: torch.Tensor) -> torch.Tensor:
    """d = 2^(e-128) built from its bits as ggml_e8m0_to_fp32_half does (subnormal for e < 2), then d * value: a
    power of two times a small integer, so exact (inf where it overflows, +0 for both zero codes)."""
    n = b.shape[0]
    e = b[:, :1].to(torch.int32)
    d = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    q = _nibbles(b[:, 1:], 1, 16).reshape(n, 32).long()
    table = torch.tensor(MXFP4_VALUES, dtype=torch.int8, device=b.device).to(F32)
    return d.view(F32) * table[q]


# type -> (values per block, bytes per block, decoder)
BLOCKS = {"Q8_0": (32, 34, q8_0), "Q4_0": (32, 18, q4_0), "Q4_K": (QK_K, 144, q4_k), "Q5_K": (QK_K, 176, q5_k),
          "Q6_K": (QK_K, 210, q6_k), "IQ4_XS": (QK_K, 136, iq4_xs), "MXFP4": (32, 17, mxfp4)}
SUPPORTED = tuple(PLAIN) + tuple(BLOCKS)


def dequantize(data: torch.Tensor, gtype: str, cols: int) -> torch.Tensor:
    """A GGUF tensor's rows as float32 [rows, cols]: `data` is [rows, cols] of a plain type, or the rows'
    bytes [rows, bytes per row] of a block type."""
    if gtype in PLAIN:
        return data.to(F32).reshape(-1, cols)
    per, size, decode = BLOCKS[gtype]
    return decode(data.reshape(-1, size)).reshape(-1, cols)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's LlamaModel.permute (rope pairs interleaved per head) on the rows of `w`."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def weight(data: torch.Tensor, q: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """kind gguf: the [out, in] weight in `dtype`."""
    w = dequantize(data, q.gtype, q.inp)
    if q.heads:
        w = unpermute(w, q.heads)
    return w.to(dtype)


def kv_b(k_b: torch.Tensor, v_b: torch.Tensor, q: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """kind gguf_kvb: DeepSeek's kv_b_proj [H * (nope + v), kv_lora] rebuilt from llama.cpp's split k_b
    [H, kv_lora, nope] (stored transposed) and v_b [H, v, kv_lora]."""
    heads, nope, rank = q.heads, q.group, q.inp
    k = dequantize(k_b, q.gtype, nope).reshape(heads, rank, nope).transpose(1, 2)
    v = dequantize(v_b, q.gtype2, rank).reshape(heads, -1, rank)
    return torch.cat((k, v), dim=1).reshape(q.out, rank).to(dtype)


INT4_TYPES = ("Q4_0", "Q4_K")  # 4-bit values with one scale and one offset per 32: the CPU int4 kernel's form
# ggml's type ids (gguf.GGMLQuantizationType) of the types the native CPU kernels read in place (kernels/native/
# gguf_blocks.h)
NATIVE_TYPES = {"Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_XS": 23, "MXFP4": 39}


def native_form(data: torch.Tensor, q: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF weight as the native CPU kernels read it: (its stored blocks as uint8 [out, bytes a row], a view: no
    copy; meta int64 [ggml type id, in, heads]: heads > 0 where llama.cpp permuted the rows, put back in order by
    the kernel)."""
    per, size, _ = BLOCKS[q.gtype]
    blocks = data.reshape(q.out, q.inp // per * size)
    return blocks, torch.tensor([NATIVE_TYPES[q.gtype], q.inp, q.heads or 0], dtype=torch.int64)


def int4_parts(data: torch.Tensor, q: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_K weight as the CPU int4 kernel reads it (runtime/kernels/cpu_int.py): u [out, in] in 0..15,
    and per 32 inputs a scale s and a term t [out, in / 32] with W = (u - 8) * s + t, exactly:
      Q4_0  W = d * (u - 8)                   s = d,       t = 0
      Q4_K  W = (d * sc) * u - dmin * m       s = d * sc,  t = 8 * s - dmin * m
    Rows llama.cpp permuted (q.heads) are put back in order."""
    b = data.reshape(-1, BLOCKS[q.gtype][1])
    n = b.shape[0]
    if q.gtype == "Q4_0":
        u = _nibbles(b[:, 2:], 1, 16).reshape(n, 32)
        s = _f16(b[:, :2])
        t = torch.zeros_like(s)
    else:
        s, dm = _k_scales(b)  # [n, 8, 1]
        u = _nibbles(b[:, 16:], 4, 32).reshape(n, 8, 32)
        s, t = s.reshape(n, 8), 8 * s.reshape(n, 8) - dm.reshape(n, 8)
    u, s, t = u.reshape(q.out, q.inp), s.reshape(q.out, -1), t.reshape(q.out, -1)
    if q.heads:
        u, s, t = (unpermute(x, q.heads) for x in (u, s, t))
    return u.to(torch.int32), s, t


def rows(data: torch.Tensor, tokens: torch.Tensor, q: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """An embedding lookup on a table stored in a GGUF type: only the looked-up rows are decoded."""
    picked = data.index_select(0, tokens.reshape(-1).long())
    return dequantize(picked, q.gtype, q.inp).reshape(*tokens.shape, q.inp).to(dtype)
