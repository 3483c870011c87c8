"""Which compute path a quantized weight takes, and the per-unit tensors the fast paths read.

The store calls `Kernels.plan` / `Kernels.build` once when a unit's views are built in a slot (TieredStore's
`prepare`): the kernels' forms of its quantized weights are added to the unit's Weights as
`<local>@k:w` (the weight as the kernel reads it), `<local>@k:s` (scales), `@k:t` (int8 zero term) and, on CUDA,
`@k:z` / `@k:m` (zero points, format numbers). They live exactly as long as the slot's views of that unit (the
store drops them with the views when the slot takes another unit or is read into again).

Where they go (store/tier.py Prepared decides): on the compute tier, whose slots are never copied from, the CPU
forms' data is written over the stored data in place (the same bytes or fewer: planner/kernel_room.py) and their
scales carved from the slot's tail, which the planner sized for them, so they cost the budget nothing more; the
stored data's name then leaves the unit's Weights, and `dense()` reads the kernel form (`kernel_dense`). Elsewhere
(a host tier that feeds another, a slot without the tail) they are new tensors charged to the tier first.
`linear()` (runtime/linear.py) calls `fast_linear`, which uses them when present and otherwise says None:
dequantize-then-matmul.

Paths (docs/FORMATS.md has the table with the tolerances measured):
  CPU   GGUF Q8_0, Q4_0, K-quants, IQ4_XS, MXFP4 in a bf16 compute -> the native kernels read the stored blocks in
        place (`@k:w` a view of them, `@k:g` their type: native/gguf_cpu.cpp; no bytes beside the unit's)
        int4: compressed-tensors int4 group/channel, GPTQ 4-bit in order, AWQ, GGUF Q4_0/Q4_K in float32 -> cpu_int
        int4 (the same bytes as the file's nibbles, plus scales/zeros in the compute dtype)
        int8 per channel: compressed-tensors pack/int-quantized, GPTQ 8-bit one group -> cpu_int int8
        fp8 (block, channel) -> the dense form in the compute dtype, made once per fill (no CPU fp8 matmul)
        everything else (mxfp4, int8 groups, act-order GPTQ, small groups) -> dequantize
  CUDA  compressed-tensors int4/int8 group/channel -> triton_int (reads the stored words: no new bytes)
        fp8 block 128x128 and compressed-tensors fp8 channel on sm90+ -> fp8 (torch._scaled_mm)
        everything else -> dequantize
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from ...checkpoint.formats import PRIMARY, QuantSpec, part_name
from ...checkpoint.layout import UnitLayout
from ...formats.registry import format_of
from ...planner.kernel_room import (ALIGN, aligned, cpu_path, data_bytes, dense_rows_in_place, quantized_specs,
                                    tail_bytes, unit_room)
from ...planner.placement import ROW_KINDS
from .. import gguf_dequant
from . import cpu_int, fp8, native_build, triton_int

W, S, T, Z, M = "@k:w", "@k:s", "@k:t", "@k:z", "@k:m"
G = "@k:g"  # a GGUF form's meta (gguf_dequant.native_form): its `@k:w` is the stored blocks
D = "@k:d"  # the dense form's rows after those its stored data holds in place (cpu_dense)


@dataclass(frozen=True)
class Planned:
    local: str
    q: QuantSpec
    path: str  # cpu_int4 | cpu_int8 | cpu_dense | cpu_gguf | triton | fp8
    tail: int  # bytes of its scales / zero terms (carved from the slot's tail, or allocated)
    copy: int  # bytes of its data where it cannot be written in place (views of the stored tensors cost none)

    @property
    def nbytes(self) -> int:
        """New bytes its kernel form allocates when neither in place nor carved."""
        return self.tail + self.copy


def laid_into(region: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` copied into the first bytes of the uint8 `region` (which holds at least as many), as a view of them."""
    dst = region[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    if dst.data_ptr() != t.data_ptr():
        dst.copy_(t)
    return dst


class Carver:
    """Tensors carved from a slot's tail (`room`, uint8), each on an ALIGN boundary of its address."""

    def __init__(self, room: torch.Tensor):
        self.room, self.at = room, (-room.data_ptr()) % ALIGN

    def fits(self, nbytes: int) -> bool:
        return self.at + nbytes <= self.room.numel()

    def place(self, t: torch.Tensor) -> torch.Tensor:
        dst = laid_into(self.room[self.at:], t)
        self.at += aligned(t.numel() * t.element_size())
        return dst


def over(data: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` written over the stored tensor `data`'s bytes (t has as many or fewer), as a view of them."""
    return laid_into(data.reshape(-1).view(torch.uint8), t)


def path_for(q: QuantSpec, device: torch.device, itemsize: int = 4) -> str | None:
    """The fast path a weight stored as `q` takes on `device` in a compute dtype of `itemsize` bytes, or None
    (dequantize). GGUF in bf16: the native kernels (without them, dequantize: the planner left no room for
    another form)."""
    if device.type == "cpu":
        path = cpu_path(q, itemsize == 2) if cpu_int.available() else None
        if path == "cpu_gguf" and (native_build.supported() is not None or native_build.load() is None):
            return None
        return path
    if device.type == "cuda":
        if format_of(q).triton_int(q) and triton_int.available():
            return "triton"
        if fp8.applies(q, device):
            return "fp8"
    return None


@dataclass
class Built:
    tensors: dict[str, torch.Tensor]  # the kernel forms' tensors, by their `<local>@k:...` names
    unused: int  # planned bytes of the forms it could not build (act-order GPTQ: its g_idx is data)
    replaced: list[str]  # stored data names whose bytes now hold a kernel form (in place)


def slot_room(layout: UnitLayout, device: torch.device, dtype: torch.dtype) -> int:
    """Bytes a slot of `device` needs beyond `layout`'s unit for the CPU kernels' forms of its weights (the
    planner sizes slots with it: planner/kernel_room.py); 0 where none applies."""
    if device.type != "cpu" or not cpu_int.available() or layout.key.kind in ROW_KINDS:
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    return unit_room((s.local for s in layout.slices), itemsize)


class Kernels:
    """The store's `prepare` hook (TieredStore(prepare=...)): built by assemble unless EngineConfig.kernels is
    "dequantize"."""

    def plan(self, views: Mapping[str, torch.Tensor], dtype: torch.dtype) -> list[Planned]:
        out = []
        itemsize = torch.empty((), dtype=dtype).element_size()
        for local, q in quantized_specs(views):
            device = next(v for k, v in views.items() if k.startswith(local + PRIMARY)).device
            path = path_for(q, device, itemsize)
            if path is None:
                continue
            if path.startswith("cpu"):
                out.append(Planned(local, q, path, tail_bytes(q, path, itemsize), data_bytes(q, path, itemsize)))
            else:
                out.append(Planned(local, q, path, 0, 0))
        return out

    def carver(self, tail: torch.Tensor) -> Carver:
        return Carver(tail)

    def build(self, views: Mapping[str, torch.Tensor], planned: list[Planned], dtype: torch.dtype,
              carver: Carver | None = None) -> Built:
        """The kernel forms of the planned weights. With `carver` (the slot's tail, sized by the planner for
        them) their data is written over the stored data in place and their other tensors carved from the tail;
        every form is computed before any stored byte is overwritten, so a failure leaves the unit as read."""
        forms: list[tuple[Planned, str, torch.Tensor, dict[str, torch.Tensor]]] = []
        unused = 0
        for p in planned:
            stored = next(k for k in views if k.startswith(p.local + PRIMARY))
            data = views[stored]
            parts = {"data": data, "scale": views.get(part_name(p.local, "scale")),
                     "zero": views.get(part_name(p.local, "zero")), "g_idx": views.get(part_name(p.local, "g_idx"))}
            got = _build(p, parts, dtype)
            if got is None:
                unused += p.nbytes
            else:
                forms.append((p, stored, data, {p.local + suffix: t for suffix, t in got.items() if t is not None}))
        built = Built({}, unused, [])
        for p, stored, data, tensors in forms:
            if carver is not None and p.path == "cpu_dense":  # first rows over the data, the rest in the tail
                full = tensors[p.local + W]
                rows = dense_rows_in_place(p.q, full.element_size())
                tensors = {p.local + W: over(data, full[:rows]), p.local + D: carver.place(full[rows:])}
                built.replaced.append(stored)
            elif carver is not None and p.path.startswith("cpu"):
                kernel_data = tensors[p.local + W]
                tensors[p.local + W] = over(data, kernel_data)
                if kernel_data.data_ptr() != data.data_ptr():
                    built.replaced.append(stored)
                for name, t in tensors.items():
                    if name not in (p.local + W, p.local + M, p.local + G):  # (metas: a few bytes, allocated)
                        tensors[name] = carver.place(t)
            built.tensors.update(tensors)
        return built


def _build(p: Planned, parts: dict, dtype: torch.dtype) -> dict[str, torch.Tensor | None] | None:
    if p.path == "cpu_dense":
        return {W: format_of(p.q).dequantize(p.q, parts, dtype)}
    if p.path == "cpu_gguf":
        blocks, meta = gguf_dequant.native_form(parts["data"], p.q)
        return {W: blocks, G: meta}
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
    meta = w.get(name + G)
    if meta is not None:  # GGUF blocks: the native kernel, any rows of bf16 x (else the caller dequantizes)
        if x.dtype is not torch.bfloat16 or x.device.type != "cpu":
            return None
        lead, k = x.shape[:-1], x.shape[-1]
        y = native_build.load().int_linear(x.reshape(-1, k).contiguous(), [packed, meta])
        return y.reshape(*lead, -1)
    if packed.dtype.is_floating_point and name + M not in w:  # the dense form (fp8 on a CPU)
        if packed.dtype != x.dtype:
            return None
        y = F.linear(x, packed)
        rest = w.get(name + D)
        return y if rest is None else torch.cat((y, F.linear(x, rest)), dim=-1)
    scale = w[name + S]
    if packed.dtype == torch.uint8:
        return cpu_int.int4_mm(x, packed, scale) if scale.dtype == x.dtype else None
    if packed.dtype == torch.int8:
        return cpu_int.int8_mm(x, packed, scale, w.get(name + T)) if scale.dtype == x.dtype else None
    if packed.dtype == torch.int32:
        return triton_int.linear(x, packed, scale, w.get(name + Z), w[name + M])
    return fp8.linear(x, packed, scale, w[name + M])


def kernel_dense(w: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight `name` as a dense [out, in] tensor from its CPU kernel form, where that form replaced the stored
    data in place (the unit no longer holds it), else None."""
    packed = w.get(name + W)
    if packed is None:
        return None
    if packed.dtype.is_floating_point:
        rest = w.get(name + D)
        return (packed if rest is None else torch.cat((packed, rest))).to(dtype)
    if packed.dtype == torch.uint8:
        return cpu_int.int4_dense(packed, w[name + S]).to(dtype)
    if packed.dtype == torch.int8:
        return cpu_int.int8_dense(packed, w[name + S], w.get(name + T)).to(dtype)
    return None
