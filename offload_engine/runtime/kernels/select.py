"""Which compute path a quantized weight takes, and the per-unit tensors the fast paths read.

The store calls `Kernels.plan` / `Kernels.build` once when a unit's views are built in a slot (TieredStore's
`prepare`): the kernels' forms of its quantized weights are added to the unit's Weights as
`<local>@k:w` (the weight as the kernel reads it), `<local>@k:s` (scales), `@k:t` (int8 zero term) and, on CUDA,
`@k:z` / `@k:m` (zero points, format numbers). They live exactly as long as the slot's views of that unit (the
store drops them with the views when the slot takes another unit) and their new bytes are charged to the slot's
tier before they are built (store/tier.py Prepared). `linear()` (runtime/linear.py) calls `fast_linear`, which
uses them when present and otherwise says None: dequantize-then-matmul.

Paths (docs/FORMATS.md has the table with the tolerances measured):
  CPU   int4: compressed-tensors int4 group/channel, GPTQ 4-bit in order, AWQ -> cpu_int int4 (repacked: the same
        bytes as the file's nibbles, plus scales/zeros in the compute dtype)
        int8 per channel: compressed-tensors pack/int-quantized, GPTQ 8-bit one group -> cpu_int int8
        everything else (fp8, mxfp4, int8 groups, act-order GPTQ, small groups) -> dequantize
  CUDA  compressed-tensors int4/int8 group/channel -> triton_int (reads the stored words: no new bytes)
        fp8 block 128x128 and compressed-tensors fp8 channel on sm90+ -> fp8 (torch._scaled_mm)
        everything else -> dequantize
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ...checkpoint.formats import PRIMARY, QuantSpec, decode, part_name
from . import cpu_int, fp8, triton_int

W, S, T, Z, M = "@k:w", "@k:s", "@k:t", "@k:z", "@k:m"


@dataclass(frozen=True)
class Planned:
    local: str
    q: QuantSpec
    path: str  # cpu_int4 | cpu_int8 | triton | fp8
    nbytes: int  # new bytes its kernel form allocates (views of the stored tensors cost none)


def quantized(views: Mapping[str, torch.Tensor]) -> list[tuple[str, QuantSpec]]:
    return [(k.split(PRIMARY, 1)[0], decode(k.split(PRIMARY, 1)[1])) for k in views if PRIMARY in k]


def path_for(q: QuantSpec, device: torch.device) -> str | None:
    """The fast path a weight stored as `q` takes on `device`, or None (dequantize)."""
    if q.kind.startswith("gguf"):  # Q4_0 / Q4_K on the CPU; the other GGUF types are dequantized
        ok = q.kind == "gguf" and device.type == "cpu" and cpu_int.available() and cpu_int.int4_group(q) is not None
        return "cpu_int4" if ok else None
    if device.type == "cpu":
        if not cpu_int.available():
            return None
        if q.bits == 4 and q.kind in ("ct_pack", "gptq", "awq") and cpu_int.int4_group(q) is not None:
            return "cpu_int4"
        if q.bits == 8 and not q.float_values and (
                (q.kind in ("ct_pack", "ct_naive") and q.strategy == "channel")
                or (q.kind == "gptq" and q.group == q.inp)):
            return "cpu_int8"
        return None
    if device.type == "cuda":
        if q.kind == "ct_pack" and q.strategy in ("group", "channel") and triton_int.available():
            return "triton"
        if fp8.applies(q, device):
            return "fp8"
    return None


def _cpu_bytes(q: QuantSpec, path: str, itemsize: int) -> int:
    if path == "cpu_int4":
        return q.out * q.inp // 2 + (q.inp // cpu_int.int4_group(q)) * q.out * 2 * itemsize
    copy = q.out * q.inp if q.kind != "ct_naive" else 0  # int-quantized data is used as stored
    return copy + 2 * q.out * itemsize


class Kernels:
    """The store's `prepare` hook (TieredStore(prepare=...)): built by assemble unless EngineConfig.kernels is
    "dequantize"."""

    def plan(self, views: Mapping[str, torch.Tensor], dtype: torch.dtype) -> list[Planned]:
        out = []
        itemsize = torch.empty((), dtype=dtype).element_size()
        for local, q in quantized(views):
            device = next(v for k, v in views.items() if k.startswith(local + PRIMARY)).device
            path = path_for(q, device)
            if path is not None:
                nbytes = _cpu_bytes(q, path, itemsize) if path.startswith("cpu") else 0
                out.append(Planned(local, q, path, nbytes))
        return out

    def build(self, views: Mapping[str, torch.Tensor], planned: list[Planned], dtype: torch.dtype
              ) -> tuple[dict[str, torch.Tensor], int]:
        """The kernel forms of the planned weights, and the bytes of those it could not build (act-order GPTQ:
        its g_idx is data), which the caller credits back."""
        extra: dict[str, torch.Tensor] = {}
        unused = 0
        for p in planned:
            data = next(v for k, v in views.items() if k.startswith(p.local + PRIMARY))
            parts = {"data": data, "scale": views.get(part_name(p.local, "scale")),
                     "zero": views.get(part_name(p.local, "zero")), "g_idx": views.get(part_name(p.local, "g_idx"))}
            got = _build(p, parts, dtype)
            if got is None:
                unused += p.nbytes
            else:
                extra.update({p.local + suffix: t for suffix, t in got.items() if t is not None})
        return extra, unused


def _build(p: Planned, parts: dict, dtype: torch.dtype) -> dict[str, torch.Tensor | None] | None:
    if p.path == "cpu_int4":
        got = cpu_int.repack_int4(p.q, parts, dtype)
        return None if got is None else {W: got[0], S: got[1]}
    if p.path == "cpu_int8":
        got = cpu_int.repack_int8(p.q, parts, dtype)
        return None if got is None else {W: got[0], S: got[1], T: got[2]}
    if p.path == "triton":
        return {W: parts["data"], S: parts["scale"], Z: parts["zero"], M: triton_int.meta(p.q)}
    return {W: parts["data"], S: parts["scale"], M: fp8.meta(p.q)}


def fast_linear(x: torch.Tensor, w: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """x @ W.T by the weight's kernel form, or None where it has none (the caller dequantizes)."""
    packed = w.get(name + W)
    if packed is None:
        return None
    scale = w[name + S]
    if packed.dtype == torch.uint8:
        return cpu_int.int4_mm(x, packed, scale) if scale.dtype == x.dtype else None
    if packed.dtype == torch.int8:
        return cpu_int.int8_mm(x, packed, scale, w.get(name + T)) if scale.dtype == x.dtype else None
    if packed.dtype == torch.int32:
        return triton_int.linear(x, packed, scale, w.get(name + Z), w[name + M])
    return fp8.linear(x, packed, scale, w[name + M])
