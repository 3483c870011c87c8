"""Which kernel a decode step's bfloat16 matmuls take on the CPU, chosen per weight shape by measuring at open.

Decode multiplies a few rows (one token, or the k of a speculative verification) by each weight: torch's bf16
matmul (oneDNN) or the engine's own kernels (native/bf16_cpu.cpp: one pass over a weight row for all rows of x,
and one call for all of a layer's routed experts; native/int_cpu.cpp: the same for routed experts stored int8 /
int4, against torch's weight-only kernels: int_experts.py). Which is faster depends on the shape and the machine,
so at open each distinct shape of the model's plain bf16 weights, and its experts' shape and form, is timed both
ways on scratch tensors of that shape (several copies, so that they come from memory as the weights will),
interleaved, best of several rounds. Where torch has no native bf16 matmul (CPUs without AVX512-BF16: it converts,
~5x slower than the native kernel at 64 rows), the plain bf16 linear takes any number of rows, a prefill's too.

The choices are stored per machine (CPU model, thread count, torch, kernel build) in
$OFFLOAD_ENGINE_CACHE/kernels/choices.json and reused: a run takes the same kernel as the last one for the same
shape, so results do not change from run to run with timing noise (delete the file to measure again). Every
choice is in the stats (`cpu_kernels`). OFFLOAD_ENGINE_NATIVE=all takes the native kernels for every shape
without measuring, =0 never (native_build.py).

The chosen kernels are passed explicitly: bound to a model's layer ops (StandardOps.with_kernels), which hand
them to linear() (runtime/linear.py) and the norms, and given to its MoE block (runtime/moe_block.py); engines
in one process each keep their own choices.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Iterable

import torch
import torch.nn.functional as F

from . import cpu_int, int_experts, native_build

MAX_ROWS = 16  # rows of x the native kernels take (more: torch's matmul, which blocks for them)
ANY_ROWS = 1 << 62  # the plain bf16 linear where torch has no native bf16 matmul (prefill too: ~5x torch's there)
ROUNDS, REPEATS, COPIES_BYTES = 5, 4, 32 << 20  # per shape: ~1-3 ms of timing each way


@dataclass
class DecodeKernels:
    module: ModuleType = field(repr=False)
    native: frozenset[tuple[int, int]]  # (out, in) weight shapes the native linear is chosen for
    experts: bool  # routed experts through native `experts` / `experts_int` (chosen against torch's per-expert path)
    timings: dict[str, dict[str, float]]  # shape -> {"torch_us": .., "native_us": ..}
    native_int: frozenset[tuple[str, int, int]] = frozenset()  # (form, out, in) of int weights native_int takes
    plain_rows: int = MAX_ROWS  # the most rows of x the plain linear takes (ANY_ROWS: torch multiplies bf16 slowly)
    gguf: bool = False  # GGUF forms (int_experts.is_gguf) take the native kernels: torch has none for them

    def _rows_fit(self, x: torch.Tensor, limit: int = MAX_ROWS) -> bool:
        """x is a decode step's few bf16 rows, what every native kernel takes (`limit`: how many)."""
        return x.dtype is torch.bfloat16 and x.dim() == 2 and x.shape[0] <= limit

    def _plain_chosen(self, weight: torch.Tensor) -> bool:
        return (weight.dtype is torch.bfloat16 and weight.stride(1) == 1
                and tuple(weight.shape) in self.native)

    def _int_parts(self, w, name: str) -> list[torch.Tensor] | None:
        """Weight `name`'s int8 / int4 kernel form as the native kernel takes it, where its form and shape chose
        the native kernel; else None."""
        form = int_experts.int_form(w, name)
        if form is None:
            return None
        if int_experts.is_gguf(form):
            return int_experts.kernel_parts(form) if self.gguf else None
        if int_experts.form_key(form) not in self.native_int:
            return None
        return int_experts.kernel_parts(form)

    def form(self, w, name: str) -> list[torch.Tensor] | None:
        """Weight `name` of unit `w` as the native kernels take it for a decode step's row, where its shape and form
        chose them: [weight] (plain bf16) or its int8 / int4 kernel parts; None where it takes torch's path."""
        plain = w.get(name)
        if plain is not None:
            return [plain] if self._plain_chosen(plain) else None
        return self._int_parts(w, name) if self.native_int or self.gguf else None

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """x @ weight.T by the native kernel where it was chosen for this shape, else None (x [..., in]: the
        leading dimensions of a prefill's rows where plain_rows takes them)."""
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x
        if not self._rows_fit(x2, self.plain_rows) or not self._plain_chosen(weight):
            return None
        return self.module.linear(x2.contiguous(), weight).view(*x.shape[:-1], weight.shape[0])

    def linears(self, x: torch.Tensor, w, names: list[str]) -> list[torch.Tensor] | None:
        """[x @ W.T for each weight in `names`] of unit `w` in one native call, where all of them take one native
        kernel (plain bf16, or int8 / int4 forms), else None. Each result is the same bits as alone."""
        if not self._rows_fit(x, self.plain_rows):
            return None
        plain = [w.get(name) for name in names]
        if all(p is not None for p in plain):
            return self.module.linears(x.contiguous(), plain) if all(map(self._plain_chosen, plain)) else None
        if not (self.native_int or self.gguf) or not self._rows_fit(x):
            return None
        forms = [self._int_parts(w, name) for name in names]
        return None if None in forms else self.module.int_linears(x.contiguous(), forms)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """layers.rms_norm of a decode step's few bf16 rows by one native call (within a bf16 rounding of torch's:
        the sum of squares in another order), else None."""
        if not self._rows_fit(x) or weight.dtype is not torch.bfloat16 or x.device.type != "cpu":
            return None
        return self.module.rms_norm_rows(x.contiguous(), weight.contiguous(), eps)

    def int_linear(self, x: torch.Tensor, w, name: str) -> torch.Tensor | None:
        """x @ W.T for weight `name` of unit `w` by the native int kernel where its form and shape chose it (its
        CPU int8 / int4 kernel form: int_experts.int_form), else None."""
        if not (self.native_int or self.gguf) or not self._rows_fit(x):
            return None
        parts = self._int_parts(w, name)
        return None if parts is None else self.module.int_linear(x.contiguous(), parts)

    def describe(self) -> dict:
        return {"native_linear": sorted(f"{n}x{k}" for n, k in self.native),
                "native_int_linear": sorted("%s:%dx%d" % key for key in self.native_int),
                "native_experts": self.experts, "timings_us": self.timings, "isa": native_build.isa(),
                "native_gguf": self.gguf,
                "native_linear_rows": "any" if self.plain_rows >= ANY_ROWS else self.plain_rows}


def _time(fn, args: list) -> float:
    start = time.perf_counter()
    for a in args:
        fn(*a)
    return (time.perf_counter() - start) / len(args) * 1e6


def _race(torch_fn, native_fn, make_args) -> tuple[float, float]:
    """Best-of-ROUNDS microseconds per call of each, interleaved (a contended CPU slows both alike)."""
    args = make_args()
    best_t = best_n = float("inf")
    for fn in (torch_fn, native_fn):  # warm up both: oneDNN's primitive cache, the first touch of the copies
        _time(fn, args[:2])
    for _ in range(ROUNDS):
        best_t = min(best_t, _time(torch_fn, args * REPEATS))
        best_n = min(best_n, _time(native_fn, args * REPEATS))
    return best_t, best_n


def _copies(nbytes: int) -> int:
    return max(2, min(16, COPIES_BYTES // max(nbytes, 1)))


def _linear_race(module: ModuleType, n: int, k: int) -> tuple[float, float]:
    n = max(1, min(n, COPIES_BYTES // (2 * k)))  # an output head's rows timed in part: the cost is per row

    def make():
        x = torch.randn(1, k).bfloat16()
        return [(x, torch.randn(n, k).bfloat16()) for _ in range(_copies(n * k * 2))]
    return _race(F.linear, module.linear, make)


def _experts_race(module: ModuleType, hidden: int, inter: int, top_k: int) -> tuple[float, float]:
    def torch_experts(xs, gates, ups, downs, weights):  # what runtime/arch/base.expert_forward does per expert
        return [F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d) * w[:, None]
                for x, g, u, d, w in zip(xs, gates, ups, downs, weights)]

    def make():
        x, w = torch.randn(1, hidden).bfloat16(), torch.rand(1).bfloat16()
        per = 3 * hidden * inter * 2 * top_k
        return [([x] * top_k, [torch.randn(inter, hidden).bfloat16() for _ in range(top_k)],
                 [torch.randn(inter, hidden).bfloat16() for _ in range(top_k)],
                 [torch.randn(hidden, inter).bfloat16() for _ in range(top_k)], [w] * top_k)
                for _ in range(_copies(per))]
    return _race(torch_experts, module.experts, make)


def _int_linear_race(module: ModuleType, form: str, n: int, k: int) -> tuple[float, float]:
    n = max(64, min(n, COPIES_BYTES // k) // 64 * 64)  # an output head's rows timed in part: the cost is per row

    def make():
        x = torch.randn(1, k).bfloat16()
        return [(x, int_experts.random_form(form, n, k)) for _ in range(_copies(n * k))]
    return _race(int_experts.torch_mm, module.int_linear, make)


def _int_experts_race(module: ModuleType, form: str, hidden: int, inter: int, top_k: int) -> tuple[float, float]:
    per = 3 * hidden * inter * top_k * (1 if form == "int8" else 0.5)
    torch_fn, native_fn, make = int_experts.race_args(module, form, hidden, inter, top_k, _copies(int(per)))
    return _race(torch_fn, native_fn, make)


def _cache_file() -> Path:
    return native_build.build_dir().parent / "choices.json"


def _machine_key(module_path: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}|{Path(module_path).parent.name}"


def choose(linear_shapes: Iterable[tuple[int, int]], experts: tuple[int, int, int] | None,
           int_shape: tuple[str, int, int, int] | None = None,
           int_linears: Iterable[tuple[str, int, int]] = ()) -> DecodeKernels | None:
    """Measure (or recall) torch against the native kernels for each (out, in) weight shape, each (form, out, in)
    of the int8 / int4 weights outside the experts (int_experts.int_linear_shapes), and the routed experts:
    plain (hidden, moe_intermediate, top_k), or int8 / int4 (form, hidden, moe_intermediate, top_k:
    int_experts.int_expert_shape); None where the native kernels are unavailable."""
    module = native_build.load() if native_build.supported() is None else None
    if module is None:
        return None
    if module.int4_block_rows() != cpu_int.int4_block_rows():  # the build reads another int4 pack than torch's
        int_shape = None if int_shape is not None and int_shape[0].startswith("int4") else int_shape  # (a forced ISA)
        int_linears = [key for key in int_linears if not key[0].startswith("int4")]
    rows = MAX_ROWS if native_build.torch_multiplies_bf16() else ANY_ROWS
    gguf = hasattr(module, "gguf_types")  # GGUF forms: native, unmeasured (torch has no kernel for them)
    gguf_experts = int_shape is not None and int_shape[0] == "gguf"
    int_shape = None if gguf_experts else int_shape
    if os.environ.get("OFFLOAD_ENGINE_NATIVE") == "all":  # every shape native, nothing measured (tests, A/B runs)
        return DecodeKernels(module, frozenset(linear_shapes), experts is not None or int_shape is not None or
                             gguf_experts, {}, frozenset(int_linears), rows, gguf)
    path = _cache_file()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    machine = stored.setdefault(_machine_key(module.__file__), {})
    changed = False
    wanted = {f"{n}x{k}": (lambda n=n, k=k: _linear_race(module, n, k)) for n, k in set(linear_shapes)}
    if experts is not None:
        wanted["experts:%dx%dx%d" % experts] = lambda: _experts_race(module, *experts)
    for form, n, k in set(int_linears):
        wanted["%s:%dx%d" % (form, n, k)] = lambda form=form, n=n, k=k: _int_linear_race(module, form, n, k)
    if int_shape is not None:
        wanted["experts-%s:%dx%dx%d" % int_shape] = lambda: _int_experts_race(module, *int_shape)
    for key, race in wanted.items():
        if key not in machine:
            t, n = race()
            machine[key] = {"torch_us": round(t, 1), "native_us": round(n, 1)}
            changed = True
    if changed:
        try:  # a read-only home keeps working: the choice is then measured again by the next run
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass
    timings = {key: machine[key] for key in wanted}
    faster = {key for key, t in timings.items() if t["native_us"] < t["torch_us"]}
    native = frozenset((int(a), int(b)) for a, b in (key.split("x") for key in faster if ":" not in key))
    native_int = frozenset(key for key in set(int_linears) if "%s:%dx%d" % key in faster)
    return DecodeKernels(module, native, gguf_experts or any(key.startswith("experts") for key in faster), timings,
                         native_int, rows, gguf)


def plain_float_shapes(layouts: Iterable) -> set[tuple[int, int]]:
    """The (out, in) shapes of the 2-D float weights the units hold as plain tensors (checkpoint layouts), the
    embedding's table aside (looked up, not multiplied)."""
    shapes = set()
    for layout in layouts:
        if layout.key.kind == "embed":
            continue
        for t in layout.slices:
            if t.dtype in ("BF16", "F16", "F32") and len(t.shape) == 2 and "@" not in t.local:
                shapes.add((int(t.shape[0]), int(t.shape[1])))
    return shapes


def expert_shape(layouts: Iterable, top_k: int, hidden_act: str) -> tuple[int, int, int] | None:
    """(hidden, moe_intermediate, top_k) of a routed expert the native kernel can take: plain gate/up/down (or
    gate_up/down) under a SiLU gate; None otherwise (quantized experts, gpt-oss's SwiGLU, dense models)."""
    if hidden_act not in ("silu", "swish") or top_k < 1:
        return None
    for layout in layouts:
        if layout.key.kind != "expert":
            continue
        shapes = {t.local: t.shape for t in layout.slices if len(t.shape) == 2}
        if "down" in shapes and "gate" in shapes and "up" in shapes:
            return int(shapes["gate"][1]), int(shapes["gate"][0]), top_k
        if "down" in shapes and "gate_up" in shapes:
            return int(shapes["gate_up"][1]), int(shapes["gate_up"][0]) // 2, top_k
        return None
    return None
