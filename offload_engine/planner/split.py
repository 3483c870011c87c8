"""Splitting a model's layers over pipeline ranks: contiguous ranges, balanced predicted step time.

Ranks run in pipeline order (stage 0 embeds the tokens, the last stage holds the head and any MTP layers). A
rank's step time for its range is a simple, exact model of one decode token:

    resident bytes read     (always + touched) / read_bps     (attention, norms, router, shared experts and dense
                                                                 MLPs: `always`; the routed experts one token
                                                                 uses on average: `touched`)
  + missed bytes read       missed / disk_bps

where the rank's memory (VRAM + RAM budget) holds, after the KV cache of its layers and its extras (the
embedding on the first stage, the head and MTP layers on the last), its layers' `always` bytes first and then
routed experts; missed = the `always` bytes that did not fit + touched x the share of experts not held. A rank
is feasible for a range when its memory holds the KV cache, the extras and the minimum working set (two
slots of the range's largest dense unit and two of its largest expert). More memory or a faster disk lowers a
rank's time for the same range, so it takes more layers.

The split minimizes the slowest rank's step time (the pipeline's throughput bound when several sequences are in
flight), then, among splits within that bound, the sum (one sequence's token latency). Predicted tok/s for one
sequence: 1 / (sum of step times + one hop per rank: the hidden state of one token over the link, plus its
latency).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import ConfigError, PlanError
from ..units import format_bytes

EPS = 1e-9


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer's bytes: `always` read by every token (its dense unit), `experts` all its routed
    experts, `touched` the expert bytes one token reads (top-k of them), its largest units, its KV bytes."""

    always: int
    experts: int = 0
    touched: float = 0.0
    largest_dense: int = 0
    largest_expert: int = 0
    kv: int = 0


@dataclass(frozen=True)
class RankSpec:
    """One rank: `memory` bytes for weights and KV (its VRAM + RAM budgets; None: unlimited), the rate it reads
    resident weights while computing (bytes/s) and its disk's read rate (bytes/s)."""

    name: str
    memory: int | None
    read_bps: float
    disk_bps: float

    def __post_init__(self):
        if not (self.read_bps > 0 and self.disk_bps > 0):
            raise ConfigError(f"rank {self.name}: read_bps and disk_bps must be > 0")


@dataclass(frozen=True)
class Extras:
    """Bytes outside the decoder layers: the embedding (first stage; read by rows, memory only), the head (last
    stage; read every token) and MTP layers (last stage; memory only)."""

    embed: int = 0
    head: int = 0
    mtp: int = 0


@dataclass
class StagePlan:
    rank: str
    start: int
    stop: int
    memory: int | None
    need: int  # the minimum this stage must hold (KV, extras, working set)
    kv: int
    weights: int  # bytes of the stage's units, extras included
    held: int  # of which the memory holds
    missed: float  # bytes read from disk per token
    step_s: float


@dataclass
class Split:
    stages: list[StagePlan]
    hop_s: float  # one hop: a token's hidden state over the link
    token_s: float = field(init=False)

    def __post_init__(self):
        self.token_s = sum(s.step_s for s in self.stages) + len(self.stages) * self.hop_s

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.stop) for s in self.stages]

    @property
    def tok_s(self) -> float:
        return 1.0 / self.token_s if self.token_s > 0 else math.inf

    def describe(self) -> str:
        lines = [f"{'rank':<10} {'layers':>9} {'memory':>11} {'needs':>11} {'kv':>11} {'weights':>11} "
                 f"{'held':>11} {'miss/token':>11} {'step ms':>9}"]
        for s in self.stages:
            memory = "unlimited" if s.memory is None else format_bytes(s.memory)
            lines.append(f"{s.rank:<10} {f'{s.start}-{s.stop - 1}':>9} {memory:>11} {format_bytes(s.need):>11} "
                         f"{format_bytes(s.kv):>11} {format_bytes(s.weights):>11} {format_bytes(s.held):>11} "
                         f"{format_bytes(s.missed):>11} {1e3 * s.step_s:>9.3f}")
        lines.append(f"hops: {len(self.stages)} x {1e3 * self.hop_s:.3f} ms; predicted {self.tok_s:.2f} tok/s "
                     f"(one sequence), slowest rank {1e3 * max(s.step_s for s in self.stages):.3f} ms/step")
        return "\n".join(lines)


def stage_plan(layers: Sequence[LayerCost], rank: RankSpec, start: int, stop: int, first: bool, last: bool,
               extras: Extras = Extras()) -> StagePlan | None:
    """The rank's step for layers [start, stop), or None when its memory cannot hold the stage's minimum."""
    part = layers[start:stop]
    kv = sum(l.kv for l in part)
    always = sum(l.always for l in part) + (extras.head if last else 0)
    experts = sum(l.experts for l in part)
    touched = sum(l.touched for l in part)
    fixed = (extras.embed if first else 0) + (extras.mtp if last else 0)
    working = 2 * max(l.largest_dense for l in part) + 2 * max(l.largest_expert for l in part)
    need = kv + fixed + working
    weights = always + experts + fixed
    if rank.memory is not None and rank.memory < need:
        return None
    free = math.inf if rank.memory is None else rank.memory - kv - fixed
    pinned = min(always, free)
    cached = min(experts, free - pinned)
    missed = (always - pinned) + (touched * (1 - cached / experts) if experts else 0.0)
    step = (always + touched) / rank.read_bps + missed / rank.disk_bps
    held = int(pinned + cached + fixed)
    return StagePlan(rank.name, start, stop, rank.memory, need, kv, weights, held, missed, step)


def split_layers(layers: Sequence[LayerCost], ranks: Sequence[RankSpec], extras: Extras = Extras(), *,
                 hop_bytes: int = 0, link_bps: float = math.inf, link_latency_s: float = 0.0) -> Split:
    """The contiguous split of `layers` over `ranks` (in pipeline order, one layer at least each) with the lowest
    slowest-rank step time, and among those the lowest sum; PlanError with each rank's numbers when none fits."""
    n, r = len(layers), len(ranks)
    if r < 1 or n < r:
        raise PlanError(f"cannot split {n} layers over {r} ranks: each rank needs at least one layer")
    cost: dict[tuple[int, int, int], StagePlan | None] = {}
    for k, rank in enumerate(ranks):
        for a in range(k, n - (r - k) + 1):
            for b in range(a + 1, n - (r - k - 1) + 1):
                cost[k, a, b] = stage_plan(layers, rank, a, b, k == 0, k == r - 1, extras)

    def best(bound: float | None) -> tuple[float, list[tuple[int, int]]] | None:
        """Bound None: minimize the slowest step; else minimize the sum with every step <= bound."""
        table: dict[tuple[int, int], tuple[float, list[tuple[int, int]]]] = {(0, 0): (0.0, [])}
        for k in range(r):
            for (done, at), (value, ranges) in [(key, v) for key, v in table.items() if key[0] == k]:
                for b in range(at + 1, n - (r - k - 1) + 1):
                    s = cost.get((k, at, b))
                    if s is None or (bound is not None and s.step_s > bound * (1 + EPS) + EPS):
                        continue
                    v = max(value, s.step_s) if bound is None else value + s.step_s
                    key = (k + 1, b)
                    if key not in table or v < table[key][0] - EPS * max(1.0, abs(v)):
                        table[key] = (v, ranges + [(at, b)])
        return table.get((r, n))

    slowest = best(None)
    if slowest is None:
        raise PlanError(_infeasible(layers, ranks, extras))
    _, ranges = best(slowest[0]) or slowest
    hop_s = (hop_bytes / link_bps if link_bps != math.inf else 0.0) + link_latency_s
    return Split([cost[k, a, b] for k, (a, b) in enumerate(ranges)], hop_s)


def _infeasible(layers: Sequence[LayerCost], ranks: Sequence[RankSpec], extras: Extras) -> str:
    """Why no split fits: each rank's memory against the smallest stage it could take."""
    n, r = len(layers), len(ranks)
    parts = []
    for k, rank in enumerate(ranks):
        needs = [stage_plan(layers, RankSpec(rank.name, None, 1, 1), a, a + 1, k == 0, k == r - 1, extras).need
                 for a in range(k, n - (r - k) + 1)]
        parts.append(f"{rank.name}: memory {format_bytes(rank.memory) if rank.memory is not None else 'unlimited'}"
                     f", its smallest stage needs {format_bytes(min(needs))}")
    return (f"no split of {n} layers over {r} ranks fits every rank's memory (each stage holds its KV cache, its "
            f"extras and two slots of its largest units): " + "; ".join(parts))
