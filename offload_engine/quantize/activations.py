"""The inputs each linear weight sees on the calibration text, collected by the engine's own runtime (CausalLM's
layer loop and the architecture's ops) run one decoder layer at a time over every calibration window.

Only one layer's units are in memory at once (its dense unit, then its experts one by one, in float32), read
from the source shards by `UnitReader`. The residual stream of every window is kept between layers. Which
weight an `F.linear` multiplies is recognised by its memory (a weight's views, such as the halves of a fused
gate_up, lie inside it), observed through a TorchFunctionMode: the runtime is run as it is, not re-implemented.
Routed experts see only the tokens routed to them. The stream entering each layer is the unquantized model's.
"""
from __future__ import annotations

import bisect
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..checkpoint.layout import TensorSlice
from ..checkpoint.naming import UnitKey
from ..checkpoint.opened import ModelCheckpoint
from ..checkpoint.stage import Stage
from ..errors import ConfigError
from ..runtime.arch import build_ops
from ..runtime.layers import causal_mask
from ..runtime.model import CausalLM
from ..units import format_bytes
from .writer import SourceReader

Target = tuple[str, int]  # (source tensor name, expert index within a fused [E, out, in] tensor, else 0)


class Gram:
    """A weight's calibration inputs: the rows themselves while there are fewer than in_features of them (less
    memory than H), then H = X^T X accumulated."""

    def __init__(self, width: int):
        self.width, self.tokens = width, 0
        self.rows: list[torch.Tensor] = []
        self.h: torch.Tensor | None = None

    def add(self, x: torch.Tensor, copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """x: the input rows; copy(x): their float32 copy to keep (shared with other weights given the same x)."""
        x = x.detach().reshape(-1, self.width)
        if self.h is None and self.tokens + x.shape[0] <= self.width:
            self.rows.append(copy(x))
        else:
            if self.h is None:
                self.h = torch.zeros(self.width, self.width)
                for r in self.rows:
                    self.h.addmm_(r.T, r)
                self.rows = []
            x = x.float()
            self.h.addmm_(x.T, x)
        self.tokens += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.h is not None:
            return self.h
        x = torch.cat(self.rows) if self.rows else torch.zeros(0, self.width)
        return x.T @ x

    def held(self) -> dict[int, int]:
        """The memory it holds, by address (rows shared with other Grams counted once by the caller)."""
        if self.h is not None:
            return {self.h.data_ptr(): self.h.nbytes}
        return {r.data_ptr(): r.nbytes for r in self.rows}


def _start(entry: tuple[int, int, Target]) -> int:
    return entry[0]


class _Observe(TorchFunctionMode):
    """Adds the input of every F.linear whose weight lies in a tracked range to that weight's Gram. One input given
    to several weights (q, k and v; gate and up) is copied once: `new_window` forgets the inputs of the last."""

    def __init__(self, grams: dict[Target, Gram], on_grow: Callable[[], None]):
        super().__init__()
        self.grams, self.on_grow = grams, on_grow
        # (start, end, target) of every tracked weight, sorted by start: one list, so that each change is one
        # operation (a SIGINT raises between bytecodes: two parallel lists could be left one entry apart)
        self.ranges: list[tuple[int, int, Target]] = []
        self.last: tuple[torch.Tensor, Target] | None = None  # gate and up of one fused tensor: one input, once
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(x) -> (x, kept alive; its copy)

    def new_window(self) -> None:
        self.last = None
        self.copies.clear()

    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        if id(x) not in self.copies:
            self.copies[id(x)] = (x, x.float().clone())
        return self.copies[id(x)][1]

    def track(self, tensors: dict[Target, torch.Tensor]) -> None:
        for target, t in tensors.items():
            start = t.data_ptr()
            self.ranges.insert(bisect.bisect(self.ranges, start, key=_start), (start, start + t.nbytes, target))

    def untrack(self, tensors: dict[Target, torch.Tensor]) -> None:
        """Forget these weights (those tracked: an interrupted `track` may have tracked only some)."""
        for t in tensors.values():
            at = bisect.bisect_left(self.ranges, t.data_ptr(), key=_start)
            if at < len(self.ranges) and self.ranges[at][0] == t.data_ptr():
                del self.ranges[at]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            at = bisect.bisect(self.ranges, weight.data_ptr(), key=_start) - 1
            if at >= 0 and weight.data_ptr() < self.ranges[at][1]:
                target = self.ranges[at][2]
                if self.last is None or self.last[0] is not x or self.last[1] != target:
                    self.grams.setdefault(target, Gram(x.shape[-1])).add(x, self._copy)
                    self.on_grow()
                self.last = (x, target)  # held, so no later tensor can be mistaken for it
        return func(*args, **kwargs)


class UnitReader:
    """The runtime's WeightSource over the source shards: each unit read when acquired, its floating tensors in
    float32; the embedding gives the rows a lookup needs. Tells the observer which weights it handed over."""

    def __init__(self, checkpoint: ModelCheckpoint, reader: SourceReader, observer: _Observe,
                 quantized: set[str]):
        self.checkpoint, self.reader, self.observer, self.quantized = checkpoint, reader, observer, quantized
        self.held: dict[UnitKey, dict[Target, torch.Tensor]] = {}

    def _tensor(self, s: TensorSlice, start: int, n: int) -> torch.Tensor:
        rec = self.checkpoint.index.tensors[s.tensor]
        raw = bytearray(self.reader.read(rec, s.file_offset - rec.offset + start, n))
        t = torch.frombuffer(raw, dtype=rec.torch_dtype) if n else torch.empty(0, dtype=rec.torch_dtype)
        return t.float() if t.is_floating_point() else t

    def _expert(self, s: TensorSlice) -> int:
        rec = self.checkpoint.index.tensors[s.tensor]
        return (s.file_offset - rec.offset) // s.nbytes if s.nbytes and len(rec.shape) == 3 else 0

    def acquire(self, keys: Sequence[UnitKey], while_waiting=None, on_host=None, after_resident=None
                ) -> Iterator[tuple[UnitKey, dict[str, torch.Tensor]]]:
        """Each unit read when asked (nothing is resident ahead, so `after_resident` comes first)."""
        if after_resident is not None:
            after_resident()
        for key in keys:
            weights, targets = {}, {}
            for s in self.checkpoint.layouts[key].slices:
                weights[s.local] = t = self._tensor(s, 0, s.nbytes).view(s.shape)
                if s.tensor in self.quantized:
                    targets[(s.tensor, self._expert(s))] = t
            self.held[key] = targets  # first: release() untracks whatever of it track() got to
            self.observer.track(targets)
            yield key, weights

    def release(self, keys: Sequence[UnitKey]) -> None:
        for key in keys:
            self.observer.untrack(self.held.pop(key, {}))

    def rows(self, key: UnitKey, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The embedding rows `ids` use (read one by one), `ids` renumbered into them."""
        distinct, renumbered = torch.unique(ids, return_inverse=True)
        out = {}
        for s in self.checkpoint.layouts[key].slices:
            width = s.shape[-1] * self.checkpoint.index.tensors[s.tensor].torch_dtype.itemsize
            rows = [self._tensor(s, int(i) * width, width) for i in distinct.tolist()]
            out[s.local] = torch.stack(rows) if len(s.shape) == 2 else self._tensor(s, 0, s.nbytes).view(s.shape)
        return out, renumbered


@dataclass
class LayerCollector:
    """Runs the calibration windows through the model one decoder layer (then the head) at a time; `collect(l)`
    returns the Grams of layer l's quantized weights (l == num_layers: the head's). Layers are visited in order;
    `limit` bounds the bytes the Grams of one layer may hold (ConfigError naming --ram past it)."""

    checkpoint: ModelCheckpoint
    reader: SourceReader
    windows: list[torch.Tensor]
    quantized: set[str]
    limit: int
    done: int = -1  # the last layer collected
    stream: list[torch.Tensor] = field(default_factory=list)  # each window's residual stream entering layer done+1
    grams: dict[Target, Gram] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.observer = _Observe(self.grams, self._check)
        self.source = UnitReader(self.checkpoint, self.reader, self.observer, self.quantized)
        c = self.checkpoint
        self.ops = build_ops(c.arch.name, c.args, torch.device("cpu"), torch.float32)
        self.num_layers = c.spec.num_layers

    def model(self, layer: int) -> CausalLM:
        stage = Stage(layer, layer + 1, self.num_layers) if layer < self.num_layers else None
        return CausalLM(self.checkpoint, self.source, torch.device("cpu"), torch.float32, ops=self.ops, stage=stage)

    def _check(self) -> None:
        held = sum({a: n for g in self.grams.values() for a, n in g.held().items()}.values())
        if held > self.limit:
            raise ConfigError(f"--ram is too small for --calibrate: the calibration inputs of one layer need more "
                              f"than {format_bytes(self.limit)} (lower --calibration-tokens or raise --ram)")

    @torch.no_grad()
    def collect(self, layer: int) -> dict[Target, Gram]:
        if layer <= self.done:
            raise ValueError(f"layer {layer} was collected already (layers are visited in order)")
        if not self.stream:
            model = self.model(0)
            self.stream = [model.embed(w) for w in self.windows]
        for skipped in range(self.done + 1, layer):  # layers without quantized weights: only advanced
            self._run(skipped, observe=False)
        self.grams.clear()
        self._run(layer, observe=True)
        self.observer.new_window()
        self.done = layer
        return dict(self.grams)

    def _run(self, layer: int, observe: bool) -> None:
        model = self.model(layer)
        for i, x in enumerate(self.stream):
            positions = torch.arange(x.shape[0])
            cache = model.new_cache(x.shape[0])
            with self.observer if observe else nullcontext():
                self.observer.new_window()
                if layer < self.num_layers:
                    self.stream[i] = model.run_layers(x, positions, cache, causal_mask(positions, x.shape[0]))
                else:
                    model.head(x)

