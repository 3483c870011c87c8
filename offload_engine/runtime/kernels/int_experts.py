"""Routed experts stored int8 / int4 on the CPU, through the native grouped kernel (native/int_cpu.cpp).

The kernel reads the same kernel forms torch's CPU kernels read (select.py `<local>@k:w`, `@k:s`, `@k:t`;
cpu_int.py says what they hold), so a unit's slot holds one form and each expert can take either path: the
native call for all of a layer's resident experts (then one per later arrival), or torch's per-expert ops.
decode.py times both per expert shape at open; this module says what a unit hands the kernel, what shape and
form a model's experts have, and what the race compares.
"""
from __future__ import annotations

from types import ModuleType
from typing import Iterable, Mapping, NamedTuple

import torch
import torch.nn.functional as F

from ...planner.kernel_room import cpu_path, int4_group, quantized_specs
from . import cpu_int
from .select import G, S, T, W


class IntExpert(NamedTuple):
    """A routed expert's int8 / int4 kernel forms as the native kernel takes them: gate, up and down, each
    [weight, scale(, zero term)]; up [] where gate is the fused gate_up form (2I rows: gate, then up)."""
    gate: list[torch.Tensor]
    up: list[torch.Tensor]
    down: list[torch.Tensor]


def int_form(w: Mapping[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(weight, scale, zero term) of weight `name`'s CPU int8 / int4 kernel form in bfloat16, or None; a GGUF form
    as (blocks, meta, None) (select.py G)."""
    meta = w.get(name + G)
    if meta is not None:
        return w[name + W], meta, None
    q, s = w.get(name + W), w.get(name + S)
    if q is None or s is None or q.dtype not in (torch.int8, torch.uint8) or s.dtype != torch.bfloat16:
        return None
    return q, s, w.get(name + T)


def kernel_parts(form: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> list[torch.Tensor]:
    """An int_form as the native kernel takes it: [weight, scale(, zero term)]."""
    return [t for t in form if t is not None]


def int_expert(w: Mapping[str, torch.Tensor]) -> IntExpert | None:
    """The unit's gate/up (or gate_up) and down as int kernel forms, or None where one of them has none (plain,
    dequantized, or a form the kernel does not read)."""
    down = int_form(w, "down")
    if down is None:
        return None
    fused = int_form(w, "gate_up")
    if fused is not None:
        return IntExpert(kernel_parts(fused), [], kernel_parts(down))
    gate, up = int_form(w, "gate"), int_form(w, "up")
    if gate is None or up is None:
        return None
    return IntExpert(kernel_parts(gate), kernel_parts(up), kernel_parts(down))


def is_gguf(form: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> bool:
    """A GGUF form (blocks, meta): the native kernel is its one fast path (no torch kernel to race)."""
    return form[1].dtype == torch.int64


def form_key(form: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> tuple[str, int, int]:
    """(form, out, in) of a kernel form: "int8", or "int4-g<group>" (what decode.py times and chooses by)."""
    q, s = form[0], form[1]
    if q.dtype == torch.int8:
        return "int8", q.shape[0], q.shape[1]
    n = s.shape[1]
    k = q.numel() * 2 // n
    return f"int4-g{k // s.shape[0]}", n, k


def _label(q) -> str | None:
    """The form a weight stored as `q` takes in a bf16 compute (decode.py's kernels exist only there)."""
    path = cpu_path(q, gguf_native=True)
    if path == "cpu_gguf":
        return "gguf"
    return "int8" if path == "cpu_int8" else f"int4-g{int4_group(q)}" if path == "cpu_int4" else None


def int_linear_shapes(layouts: Iterable) -> set[tuple[str, int, int]]:
    """(form, out, in) of the weights outside the routed experts that take a CPU int kernel form."""
    shapes = set()
    for layout in layouts:
        if layout.key.kind in ("expert", "embed"):
            continue
        for _, q in quantized_specs(t.local for t in layout.slices):
            if (label := _label(q)) is not None and label != "gguf":  # (GGUF forms: always native)
                shapes.add((label, q.out, q.inp))
    return shapes


def int_expert_shape(layouts: Iterable, top_k: int, hidden_act: str) -> tuple[str, int, int, int] | None:
    """(form, hidden, moe_intermediate, top_k) of a routed expert whose gate/up/down all take one CPU int kernel
    (form "int8", "int4-g<group>" or "gguf": GGUF types, which may differ between them) under a SiLU gate; None
    otherwise."""
    if hidden_act not in ("silu", "swish") or top_k < 1:
        return None
    layout = next((l for l in layouts if l.key.kind == "expert"), None)
    if layout is None:
        return None
    specs = dict(quantized_specs(t.local for t in layout.slices))
    gate = specs.get("gate_up", specs.get("gate"))
    if gate is None or "down" not in specs or ("gate_up" not in specs and "up" not in specs):
        return None
    labels = {_label(q) for q in specs.values()}
    if len(labels) != 1 or None in labels:
        return None
    form = labels.pop()
    inter = gate.out // 2 if "gate_up" in specs else gate.out
    return form, gate.inp, inter, top_k


def random_form(form: str, n: int, k: int) -> list[torch.Tensor]:
    """A kernel form of shape [n, k] with random contents (for timing)."""
    if form == "int8":
        return [torch.randint(-128, 128, (n, k), dtype=torch.int8), (torch.rand(n) / 50).bfloat16()]
    g = int(form.split("-g")[1])
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    return [cpu_int.int4_pack_bytes(packed), cpu_int.scales_and_zeros(torch.rand(n, k // g) / 50,
                                                                      torch.zeros(n, k // g), g, g, torch.bfloat16)]


def torch_mm(x: torch.Tensor, form: list[torch.Tensor]) -> torch.Tensor:
    """What select.fast_linear computes with the form: torch's CPU weight-only kernel."""
    if form[0].dtype == torch.uint8:
        return cpu_int.int4_mm(x, form[0], form[1])
    return cpu_int.int8_mm(x, form[0], form[1], form[2] if len(form) > 2 else None)


def race_args(module: ModuleType, form: str, hidden: int, inter: int, top_k: int, copies: int):
    """(torch's per-expert path, the native call, a function making `copies` argument tuples) for decode's race."""
    def torch_experts(xs, gates, ups, downs, weights):  # runtime/arch/base.expert_forward + moe.expert_part
        return [torch_mm(F.silu(torch_mm(x, g)) * torch_mm(x, u), d) * w[:, None]
                for x, g, u, d, w in zip(xs, gates, ups, downs, weights)]

    def make():
        x, w = torch.randn(1, hidden).bfloat16(), torch.rand(1).bfloat16()
        return [([x] * top_k, [random_form(form, inter, hidden) for _ in range(top_k)],
                 [random_form(form, inter, hidden) for _ in range(top_k)],
                 [random_form(form, hidden, inter) for _ in range(top_k)], [w] * top_k) for _ in range(copies)]
    return torch_experts, module.experts_int, make
