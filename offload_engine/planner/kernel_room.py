"""Which CPU kernel a quantized weight takes, and the room its kernel form needs beside the stored bytes.

The CPU kernels (runtime/kernels/cpu_int.py) read a weight repacked once when its unit lands in a slot. The
repacked data has the stored data's bytes or fewer (int4: N*K/2, as many as the file's nibbles; int8: N*K), so
where the unit's slot is never copied from (the compute tier) it is written over the stored data in place; what
the kernel needs besides, its scales (and zero terms) in the compute dtype, goes in the slot's tail, after the
unit's bytes. The planner sizes every slot of a kind for its unit plus that tail (`unit_room`), so an offloaded
run computes every unit with the kernel and its budget still holds: the figure here is what both the planner
and the store's carving use, one formula for both.

fp8 weights have no CPU kernel: their form is the dense matrix in the compute dtype ("cpu_dense"), dequantized
once when the unit lands instead of at every use (1.6-2.7 ms per bench expert: several disk reads of it). The
stored data (one byte a value) holds its first rows in place and the tail the rest, so the slot costs what the
dense checkpoint's unit would (plus the scales), while a miss reads half (bf16) of its bytes.

A pure function of the QuantSpec: whether torch has the kernels at all is the runtime's question
(cpu_int.available()).
"""
from __future__ import annotations

from typing import Iterable

from ..checkpoint.formats import PRIMARY, QuantSpec, decode
from ..formats.registry import format_of

ALIGN = 64  # each tensor carved from a slot's tail starts on this boundary


def int4_group(q: QuantSpec) -> int | None:
    """The kernel group size for a weight whose format groups `q.group` inputs (all of them for channel
    strategies): the largest kernel size dividing it (scales repeated), or None (its format says:
    WeightFormat.int4_group)."""
    return format_of(q).int4_group(q)


def cpu_path(q: QuantSpec, gguf_native: bool = False) -> str | None:
    """cpu_int4 | cpu_int8 | cpu_dense | cpu_gguf for a weight stored as `q` that takes a CPU form, else None
    (dequantize). gguf_native: the compute is bf16 (itemsize 2), where the native kernels read GGUF blocks in place
    (cpu_gguf); in float32 Q4_0 / Q4_K take torch's int4 kernel (scales in float32, exact). Each format answers
    for its own weights (WeightFormat.cpu_path)."""
    return format_of(q).cpu_path(q, gguf_native)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def dense_rows_in_place(q: QuantSpec, itemsize: int) -> int:
    """Rows of an fp8 weight's dense form that its stored data (one byte a value) holds in place."""
    return q.out // itemsize


def tail_bytes(q: QuantSpec, path: str, itemsize: int) -> int:
    """The kernel form's tensors besides its data, carved from the slot's tail: int4's scales and zero terms
    [K/g, N, 2]; int8's scales [N] and zero terms [N]; the dense form's rows its stored data does not hold."""
    if path == "cpu_dense":
        return aligned((q.out - dense_rows_in_place(q, itemsize)) * q.inp * itemsize)
    if path == "cpu_gguf":  # the stored blocks themselves
        return 0
    if path == "cpu_int4":
        return aligned((q.inp // int4_group(q)) * q.out * 2 * itemsize)
    return 2 * aligned(q.out * itemsize)


def data_bytes(q: QuantSpec, path: str, itemsize: int) -> int:
    """The kernel form's data: written over the stored data in place, or a copy where that is not allowed (the
    dense form: its whole matrix, the tail's rows included; int-quantized int8 is used as stored: none)."""
    if path == "cpu_dense":
        return q.out * q.inp * itemsize - tail_bytes(q, path, itemsize)
    if (path == "cpu_int8" and format_of(q).int8_as_stored) or path == "cpu_gguf":
        return 0
    return q.out * q.inp // 2 if path == "cpu_int4" else q.out * q.inp


def quantized_specs(names: Iterable[str]) -> list[tuple[str, QuantSpec]]:
    """(weight, QuantSpec) of every quantized weight among a unit's tensor names (`<weight>@q:<tag>`)."""
    return [(n.split(PRIMARY, 1)[0], decode(n.split(PRIMARY, 1)[1])) for n in names if PRIMARY in n]


def unit_room(names: Iterable[str], itemsize: int) -> int:
    """Bytes a slot needs beyond a unit with these tensors for the CPU kernels' forms of its weights."""
    return room_for((q for _, q in quantized_specs(names)), itemsize)


def room_for(specs: Iterable[QuantSpec], itemsize: int) -> int:
    """The tails of these weights' kernel forms, plus the alignment of the tail's start (0 if none applies)."""
    tails = [tail_bytes(q, p, itemsize) for q in specs if (p := cpu_path(q, itemsize == 2)) is not None]
    return ALIGN + sum(tails) if tails else 0
