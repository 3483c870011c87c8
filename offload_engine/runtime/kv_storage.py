"""How the KV cache stores one tensor of a layer's entries (K, V, MLA's latent or its rope key): one small class
per --kv-dtype (modes.KV_DTYPES), each allocated once for the cache's capacity, behind the same four members:

    write(start, x)   store x [T, ...] at positions start .. start + T - 1
    read(end)         positions 0 .. end - 1 in the compute dtype (what attention multiplies)
    tensors           every buffer, [capacity, ...] each: what `KVCache.keep` compacts and `nbytes` counts

`auto` keeps the entries as given (read returns a view: today's cache, bit for bit). fp8 and int8 quantize each
row (one position's vector over the last dimension: a KV head's K or V, MLA's whole latent or rope key) on its
own, symmetric absmax, with one fp32 scale per row, so a position's stored value never depends on which other
positions shared its forward (chunked prefill, a speculative verify pass). Reads dequantize only the positions
asked for. planner/kv.py kv_row_bytes charges exactly these bytes.
"""
from __future__ import annotations

from typing import Protocol

import torch



class KVStorage(Protocol):
    tensors: tuple[torch.Tensor, ...]
    compute: torch.dtype  # what `read` returns

    def write(self, start: int, x: torch.Tensor) -> None: ...
    def read(self, end: int) -> torch.Tensor: ...


class PlainStorage:
    """Values in `dtype` (the compute dtype for auto, bf16 for bf16), cast back to the compute dtype when read."""

    def __init__(self, capacity: int, shape: tuple[int, ...], dtype: torch.dtype, compute: torch.dtype,
                 device: torch.device):
        self.buf = torch.empty((capacity, *shape), dtype=dtype, device=device)
        self.compute = compute
        self.tensors = (self.buf,)

    def write(self, start: int, x: torch.Tensor) -> None:
        self.buf[start:start + x.shape[0]] = x

    def read(self, end: int) -> torch.Tensor:
        view = self.buf[:end]
        return view if view.dtype == self.compute else view.to(self.compute)


class QuantizedStorage:
    """One byte per value (int8 or fp8 e4m3) and one fp32 scale per row: x ~ data * scale, scale = absmax / qmax."""

    def __init__(self, capacity: int, shape: tuple[int, ...], dtype: torch.dtype, qmax: float,
                 compute: torch.dtype, device: torch.device):
        self.data = torch.empty((capacity, *shape), dtype=dtype, device=device)
        self.scale = torch.empty((capacity, *shape[:-1], 1), dtype=torch.float32, device=device)
        self.qmax, self.compute = qmax, compute
        self.tensors = (self.data, self.scale)

    def write(self, start: int, x: torch.Tensor) -> None:
        x = x.float()
        scale = x.abs().amax(dim=-1, keepdim=True) / self.qmax
        q = x / scale.clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero row: zeros, scale 0
        if not self.data.dtype.is_floating_point:
            q = q.round()
        end = start + x.shape[0]
        self.data[start:end] = q.clamp(-self.qmax, self.qmax).to(self.data.dtype)  # the clamp: absmax's rounding
        self.scale[start:end] = scale

    def read(self, end: int) -> torch.Tensor:
        # in place: a second fresh [end, ...] buffer for the product cost ~7x the multiply on CPU (page faults)
        return self.data[:end].to(torch.float32).mul_(self.scale[:end]).to(self.compute)


QUANTIZED = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max)}


def new_storage(kv_dtype: str, capacity: int, entry: torch.Tensor, device: torch.device) -> KVStorage:
    """Storage for `capacity` positions of entries shaped like `entry` [T, ...], read back in its dtype.
    kv_dtype: one of modes.KV_DTYPES, checked by the cache (planner.kv.check_kv_dtype)."""
    shape, compute = tuple(entry.shape[1:]), entry.dtype
    if kv_dtype in QUANTIZED:
        dtype, qmax = QUANTIZED[kv_dtype]
        return QuantizedStorage(capacity, shape, dtype, qmax, compute, device)
    return PlainStorage(capacity, shape, torch.bfloat16 if kv_dtype == "bf16" else compute, compute, device)
