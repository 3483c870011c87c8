"""Splitting a model's layers over pipeline ranks: contiguous ranges, balanced predicted step time.

Ranks run in pipeline order (stage 0 embeds the tokens, the last stage holds the head and any MTP layers). A
rank's step time for its range is a simple, exact model of one decode token. The rank's memory tiers, fastest
first (VRAM, then RAM; a CPU rank has RAM only), hold after the KV cache of its layers (on the first tier) and
its extras (the embedding on the first stage, MTP layers on the last: on the last tier) its layers' `always`
bytes first (attention, norms, router, shared experts, dense MLPs, the head on the last stage), then routed
experts; what no tier holds is read from the rank's disk. Per token the rank reads every `always` byte and
`touched` expert bytes (top-k of each layer's experts, spread over the tiers as the experts are: uniform
routing, no locality, so a conservative figure), each at its tier's rate (VRAM: the GPU's memory bandwidth;
RAM on a GPU rank: the PCIe copy; disk: the NVMe):

    step_s = sum over tiers of bytes read from the tier / its rate

A rank is feasible for a range when its first tier holds the KV cache and the minimum working set (two slots of
the range's largest dense unit and two of its largest expert), and its tiers hold the extras. More memory or a
faster disk lowers a rank's time for the same range, so it takes more layers.

The split minimizes the slowest rank's step time (the pipeline's throughput bound when several sequences are in
flight), then, among splits within that bound, the sum (one sequence's token latency). Predicted tok/s for one
sequence: 1 / (sum of step times + one hop per rank: the hidden state of one token over the link, plus its
latency).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..checkpoint.hf_config import ModelSpec
from ..checkpoint.naming import UnitKey
from ..errors import ConfigError, PlanError
from ..units import format_bytes
from .kv import kv_bytes

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
class Tier:
    memory: int | None  # bytes (None: unlimited)
    read_bps: float  # bytes per second a token's compute reads its weights from this tier at


@dataclass(frozen=True)
class RankSpec:
    """One rank: its memory tiers fastest first, and its disk's read rate (bytes/s)."""

    name: str
    tiers: tuple[Tier, ...]
    disk_bps: float

    def __post_init__(self):
        if not self.tiers or not all(t.read_bps > 0 for t in self.tiers) or not self.disk_bps > 0:
            raise ConfigError(f"rank {self.name}: at least one memory tier, every rate > 0")

    @property
    def memory(self) -> int | None:
        return None if any(t.memory is None for t in self.tiers) else sum(t.memory for t in self.tiers)


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
    held: list[int]  # per tier: weight bytes it holds (extras included)
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
        lines = [f"{'stage':<5} {'rank':<16} {'layers':>7} {'memory':>11} {'needs':>10} {'kv':>10} "
                 f"{'weights':>11} {'held (per tier)':>24} {'disk/token':>11} {'step ms':>9}"]
        for i, s in enumerate(self.stages):
            memory = "unlimited" if s.memory is None else format_bytes(s.memory)
            held = " + ".join(format_bytes(h) for h in s.held)
            lines.append(f"{i:<5} {s.rank:<16} {f'{s.start}-{s.stop - 1}':>7} {memory:>11} {format_bytes(s.need):>10} "
                         f"{format_bytes(s.kv):>10} {format_bytes(s.weights):>11} {held:>24} "
                         f"{format_bytes(s.missed):>11} {1e3 * s.step_s:>9.2f}")
        lines.append(f"hops: {len(self.stages)} x {1e3 * self.hop_s:.3f} ms; predicted {self.tok_s:.2f} tok/s for "
                     f"one sequence; slowest rank {1e3 * max(s.step_s for s in self.stages):.2f} ms/step "
                     f"(uniform routing: no expert locality)")
        lines.append(f"stage s runs on rank s + 1, the last stage on rank 0 (it samples): "
                     f"run --split {','.join(f'{a}:{b}' for a, b in self.ranges)} uses this split")
        return "\n".join(lines)


def stage_plan(layers: Sequence[LayerCost], rank: RankSpec, start: int, stop: int, first: bool, last: bool,
               extras: Extras = Extras()) -> StagePlan | None:
    """The rank's step for layers [start, stop), or None when it cannot hold the stage's minimum."""
    part = layers[start:stop]
    kv = sum(l.kv for l in part)
    always = sum(l.always for l in part) + (extras.head if last else 0)
    experts = sum(l.experts for l in part)
    touched = sum(l.touched for l in part)
    fixed = (extras.embed if first else 0) + (extras.mtp if last else 0)
    working = 2 * max(l.largest_dense for l in part) + 2 * max(l.largest_expert for l in part)
    need = kv + working + fixed
    free = [math.inf if t.memory is None else t.memory for t in rank.tiers]
    free[0] -= kv
    if free[0] < working:
        return None
    free[-1] -= fixed  # extras on the last (largest) tier
    if free[-1] < (working if len(free) == 1 else 0):
        return None
    held, time, left_always, left_experts = [], 0.0, always, experts
    for tier, room in zip(rank.tiers, free):
        a = min(left_always, room)
        e = min(left_experts, room - a)
        left_always, left_experts = left_always - a, left_experts - e
        held.append(int(a + e))
        time += (a + (touched * e / experts if experts else 0.0)) / tier.read_bps
    missed = left_always + (touched * left_experts / experts if experts else 0.0)
    held[-1] += fixed
    return StagePlan(rank.name, start, stop, rank.memory, need, kv, always + experts + fixed, held, missed,
                     time + missed / rank.disk_bps)


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
            for (_, at), (value, ranges) in [(key, v) for key, v in table.items() if key[0] == k]:
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
        unlimited = RankSpec(rank.name, tuple(Tier(None, 1.0) for _ in rank.tiers), 1.0)
        needs = [stage_plan(layers, unlimited, a, a + 1, k == 0, k == r - 1, extras).need
                 for a in range(k, n - (r - k) + 1)]
        tiers = " + ".join("unlimited" if t.memory is None else format_bytes(t.memory) for t in rank.tiers)
        parts.append(f"{rank.name}: memory {tiers}, its smallest stage needs {format_bytes(min(needs))}")
    return (f"no split of {n} layers over {r} ranks fits every rank's memory (each stage holds its KV cache and "
            f"two slots of its largest units in its fastest tier, and its extras): " + "; ".join(parts))


def layer_costs(units: Mapping[UnitKey, int], spec: ModelSpec, context: int, itemsize: int
                ) -> tuple[list[LayerCost], Extras]:
    """Each decoder layer's bytes from the units' bytes (a checkpoint's layouts, or the planner's sizes from
    config.json), with its KV cache for `context` positions; MTP units count as extras of the last stage."""
    n = spec.num_layers
    dense, experts, largest, counts = [0] * n, [0] * n, [0] * n, [0] * n
    extras = {"embed": 0, "head": 0, "mtp": 0}
    for key, nbytes in units.items():
        if key.kind == "dense" and 0 <= key.layer < n:
            dense[key.layer] += nbytes
        elif key.kind == "expert" and 0 <= key.layer < n:
            experts[key.layer] += nbytes
            counts[key.layer] += 1
            largest[key.layer] = max(largest[key.layer], nbytes)
        elif key.kind in ("embed", "head"):
            extras[key.kind] += nbytes
        else:  # MTP units and their experts
            extras["mtp"] += nbytes
    k = spec.num_experts_per_tok
    return ([LayerCost(dense[l], experts[l], experts[l] * k / counts[l] if counts[l] else 0.0, dense[l],
                       largest[l], kv_bytes(spec, context, itemsize, layers=range(l, l + 1))) for l in range(n)],
            Extras(**extras))
