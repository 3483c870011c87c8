"""CUDA: fused dequantize-and-multiply for compressed-tensors pack-quantized int4 / int8 (group or channel
strategy, symmetric or with zero points), reading the stored int32 words where they lie (no repacked copy).

Decode-shaped: one program per (row of x, block of outputs), looping over the inputs; each loads its words once
per value they hold (from L1/L2), unpacks value = ((word >> (bits * (k % per))) & mask) - 2^(bits-1), subtracts
the group's zero point, multiplies by the group's scale and accumulates x . w in float32. Rows of x beyond
MAX_ROWS (prefill) go to dequantize-then-matmul, where a GEMM is the better kernel.

Importable without triton or CUDA (`available()` says False). Written without a GPU to run it: it checks itself
on first use (`_checked`) and stays off where it fails; tests/test_kernels.py's cuda-marked tests check it.
"""
from __future__ import annotations

import logging

import torch

from ...checkpoint.formats import QuantSpec
from .. import dequant

try:  # triton ships with torch's CUDA wheels; absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

log = logging.getLogger(__name__)
SELF_CHECK_TOLERANCE = 1e-2  # relative max error vs dequantize (fp32 accumulation of the same products)
MAX_ROWS = 16  # decode and small verification batches; larger inputs dequantize and use a GEMM
BLOCK_N, BLOCK_K = 64, 128


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def meta(q: QuantSpec) -> torch.Tensor:
    """The numbers the kernel needs, kept beside the unit's tensors: bits, inputs, inputs per scale group."""
    group = q.inp if q.strategy == "channel" or q.group == 0 else q.group
    return torch.tensor([q.bits, q.inp, group], dtype=torch.int64)


if triton is not None:
    @triton.jit
    def _int_gemv(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K, w_stride, s_stride, z_stride,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        PER = 32 // BITS
        MASK = (1 << BITS) - 1
        OFFSET = 1 << (BITS - 1)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + row * K + k, mask=k_ok, other=0.0).to(tl.float32)
            ok = n_ok[:, None] & k_ok[None, :]
            words = tl.load(w_ptr + n[:, None] * w_stride + (k // PER)[None, :], mask=ok, other=0)
            q = ((words >> ((k % PER) * BITS)[None, :]) & MASK) - OFFSET
            g = k // GROUP
            s = tl.load(s_ptr + n[:, None] * s_stride + g[None, :], mask=ok, other=0.0).to(tl.float32)
            v = q.to(tl.float32)
            if HAS_ZERO:  # zero points packed along the outputs: word n // PER of column g
                zw = tl.load(z_ptr + (n // PER)[:, None] * z_stride + g[None, :], mask=ok, other=0)
                z = ((zw >> ((n % PER) * BITS)[:, None]) & MASK) - OFFSET
                v = v - z.to(tl.float32)
            acc += tl.sum(v * s * x[None, :], axis=1)
        tl.store(y_ptr + row * N + n, acc, mask=n_ok)


_verdict: dict[tuple[int, bool], bool] = {}  # (bits, zero points) -> passed its first-use check


def _checked(x2, packed, scale, zero, bits: int, group: int) -> bool:
    """Once per (bits, zero points) and process: the kernel compiles and agrees with dequantize-then-matmul on
    the first weight it meets, else it stays off (with a warning) and that weight kind dequantizes."""
    key = (bits, zero is not None)
    if key not in _verdict:
        n, k = packed.shape[0], x2.shape[1]
        q = QuantSpec("ct_pack", n, k, bits=bits, strategy="group", group=group, symmetric=zero is None)
        try:
            got = _launch(x2, packed, scale, zero, bits, group).float()
            ref = x2.float() @ dequant.ct_pack(packed, scale.reshape(n, -1), zero, q, torch.float32).t()
            err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
            _verdict[key] = err <= SELF_CHECK_TOLERANCE
            if not _verdict[key]:
                log.warning("triton int%d kernel off: relative error %.3g vs dequantize", bits, err)
        except Exception as e:  # a compile or launch failure on this GPU / triton: dequantize instead
            _verdict[key] = False
            log.warning("triton int%d kernel off: %s", bits, e)
    return _verdict[key]


def linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
           info: torch.Tensor) -> torch.Tensor | None:
    """x @ W.T for W stored pack-quantized, or None (more rows than a GEMV shape, or no triton): dequantize."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if not available() or x2.shape[0] > MAX_ROWS or not x.is_cuda:
        return None
    bits, inp, group = (int(v) for v in info.tolist())
    if inp != k or not _checked(x2.contiguous(), packed, scale, zero, bits, group):
        return None
    return _launch(x2.contiguous(), packed, scale, zero, bits, group).to(x.dtype).reshape(*lead, -1)


def _launch(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
            group: int) -> torch.Tensor:
    k = x2.shape[1]
    n = packed.shape[0]
    y = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x2.device)
    scale = scale.reshape(n, -1)
    z = zero if zero is not None else packed  # any int32 pointer: not read without HAS_ZERO
    grid = (x2.shape[0], triton.cdiv(n, BLOCK_N))
    _int_gemv[grid](x2, packed, scale, z, y, n, k, packed.stride(0), scale.stride(0), z.stride(0),
                    BITS=bits, GROUP=group, HAS_ZERO=zero is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
