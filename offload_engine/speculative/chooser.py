"""When and how far to speculate: the one place that weighs drafting and verification costs against acceptance.

Glossary:
  t(T)       seconds of one target forward over T tokens. Its marginal cost comes from the routed experts the
             T tokens touch together: x(T) = E (1 - (1 - k/E)^T) / k is the expected number of distinct experts
             per MoE layer relative to one token (independent routing; for dense models x(T) = T). The model
             is t(T) = t(1) (1 + gamma (x(T) - 1)); gamma (the share of a forward that scales with that union:
             missing-expert bytes at the store's measured bandwidth, plus expert compute) is fitted from every
             forward timed so far (the prefill too, as one observation), and a per-T running median replaces
             the model once a T has been seen four times (before that, the lower of the two)
  acceptance per drafter, depth d and sibling rank r: P(rank r accepted | depth d reached, ranks < r rejected),
             Beta-smoothed, each depth shrunk towards the one above
  E(D, W)    expected tokens per step of a chain of depth D with W - 1 siblings per depth
  plan       the (drafter, depth, width) maximizing E / (draft time + t(1 + D W)); "don't speculate" unless
             that beats 1 / t(1) by `margin`

Drafters whose proposals cost nothing (n-gram) are scored in the shadow of plain steps: their proposal is
compared with the tokens that plain decoding then produces, so acceptance is learned without paying for
speculation. Others are probed at depth 1 (at most every `probe_every` plain steps) while two conditions hold:
the drafter could win at all (even at 90% acceptance, a drafter whose drafting costs about a target forward,
like the self drafter where reads are cheap, never pays off), and the probes' measured extra cost (an MTP
probe first catches its layers up on the context) stays within `explore` (3%) of the decode time so far.
Shadow-scored drafters predicted to nearly win are retried under the same budget, so that a few slow timings
of a tree size (load spikes on a shared machine) cannot rule it out for good.

Speculation must pay in seconds, not only in the model's estimate: each drafter's realized seconds per token
over its last REALIZED_WINDOW speculative steps (drafting, verification and everything a step costs that the
estimate misses: expert reads that evict what plain steps would have hit, bookkeeping) is compared with the
median plain step. A drafter slower than plain decoding is benched for BENCH_FIRST steps, doubled each time it
loses again; its acceptance keeps being learned meanwhile where it is shadow-scored.

`timed=False` (seeded sampling): plans must not depend on wall-clock measurements, or a seeded run would not
reproduce (rejection sampling draws differ with the drafts). Times are then the priors (t(1) = 1, gamma as
given, drafting at its prior share), and only acceptance, which is a function of the run itself, is learned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..planner.costs import union_share


OPTIMISTIC = 1.9  # tokens per step a depth-1 draft yields at 90% acceptance (the bound a probe must beat)
PRIOR_FIRST, PRIOR_SIBLING, STRENGTH = 0.3, 0.1, 2.0  # acceptance priors (chain node, sibling) and their weight
GAMMA_PRIOR_WEIGHT = 1.0  # observations' worth of weight the gamma prior keeps
NEAR_MISS = 0.8  # a shadow-scored drafter predicted within this factor of winning is retried (exploration budget)
PLAN_SHARE = 0.01  # a plain verdict stands as many steps as keep planning within this share of the decode time
# (a plan of ~0.2-0.3 ms is a sixth of a 1.8 ms step of the bundled demo model, where speculation nearly pays and
# it re-planned every step)
REPLAN_EVERY, CLEAR_LOSS = 4, 0.9  # a plain verdict with every plan below CLEAR_LOSS x plain's rate stands this
# many steps: planning costs ~0.1-0.3 ms, a tenth of a step of a small resident model; new acceptance evidence
# (a shadow-scored n-gram proposal ending) re-plans at once


REALIZED_WINDOW, BENCH_FIRST = 8, 32  # spec steps a drafter is judged over; steps it sits out after a loss


class RecentMedian:
    """A running estimate of a time: the median of the last `window` observations (a shared machine's load
    spikes would drag a mean; one slow plain step must not make speculation look cheap)."""

    def __init__(self, window: int = 7):
        self.window, self.count, self._last, self.value = window, 0, [], 0.0

    def add(self, x: float) -> None:
        """The median is taken here, once per observation: a plan reads it a few dozen times per step."""
        self._last = (self._last + [x])[-self.window:]
        self.count += 1
        s = sorted(self._last)
        self.value = s[len(s) // 2]


@dataclass
class SpecStats:
    """What a speculative run did; `as_dict` is what the engine adds to Completion.stats / --json."""

    target_forwards: int = 0  # prefill + every decode forward of the target
    steps: int = 0  # decode steps (each ends with one target forward)
    spec_steps: int = 0  # steps that verified a draft tree
    drafted: int = 0  # draft nodes verified
    accepted: int = 0  # draft tokens accepted
    accept_hist: list[int] = field(default_factory=list)  # spec steps by number of accepted drafts
    draft_s: float = 0.0
    verify_s: float = 0.0
    by_drafter: dict[str, list[int]] = field(default_factory=dict)  # name -> [spec steps, accepted]

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.spec_steps if self.spec_steps else 0.0

    def record(self, drafter: str, nodes: int, accepted: int) -> None:
        self.spec_steps += 1
        self.drafted += nodes
        self.accepted += accepted
        while len(self.accept_hist) <= accepted:
            self.accept_hist.append(0)
        self.accept_hist[accepted] += 1
        mine = self.by_drafter.setdefault(drafter, [0, 0])
        mine[0] += 1
        mine[1] += accepted

    def as_dict(self) -> dict[str, Any]:
        return {
            "mean_accepted": self.mean_accepted,
            "accept_hist": list(self.accept_hist),
            "target_forwards": self.target_forwards,
            "spec_steps": self.spec_steps,
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "by_drafter": {k: {"steps": v[0], "accepted": v[1]} for k, v in self.by_drafter.items()},
        }


@dataclass(frozen=True)
class DraftChoice:
    drafter: str | None  # None: a plain step
    depth: int = 0
    width: int = 1
    probe: bool = False


class _Acceptance:
    """Beta-smoothed conditional acceptance per (depth, rank)."""

    def __init__(self):
        self.counts: dict[tuple[int, int], list[float]] = {}  # (depth, rank) -> [accepted, rejected]
        self._expected: dict[tuple[int, int, int], list[float]] = {}  # (depth, width, W) -> E(D, W), until `add`

    def add(self, depth: int, rank: int, accepted: bool) -> None:
        c = self.counts.setdefault((depth, rank), [0.0, 0.0])
        c[0 if accepted else 1] += 1.0
        self._expected.clear()

    def expected(self, depth: int, width: int, chain_width: int) -> list[float]:
        """_expected(table(depth, width), chain_width), kept until the next observation: a plan asks for it at
        every step and acceptance only changes when a draft is verified."""
        key = (depth, width, chain_width)
        got = self._expected.get(key)
        if got is None:
            got = self._expected[key] = _expected(self.table(depth, width), chain_width)
        return got

    def rate(self, depth: int, rank: int) -> float:
        return self.table(depth, rank + 1)[depth - 1][rank]

    def table(self, depth: int, width: int) -> list[list[float]]:
        """rates[d - 1][r] for depths 1..depth and ranks 0..width - 1 (each depth's prior: the one above)."""
        out, above = [], [PRIOR_FIRST] + [PRIOR_SIBLING] * (width - 1)
        for d in range(1, depth + 1):
            row = []
            for r in range(width):
                a, n = self.counts.get((d, r), (0.0, 0.0))
                row.append((a + above[r] * STRENGTH) / (a + n + STRENGTH))
            out.append(row)
            above = row
        return out

    def observations(self) -> float:
        return sum(a + r for a, r in self.counts.values())


@dataclass
class _Realized:
    """A drafter's recent speculative steps as (seconds, tokens emitted), and when it may speculate again."""

    steps: list[tuple[float, int]] = field(default_factory=list)
    benched_until: int = 0  # step number
    bench: int = BENCH_FIRST  # the next bench's length

    def seconds_per_token(self) -> float:
        return sum(s for s, _ in self.steps) / max(sum(t for _, t in self.steps), 1)


class CostModel:
    def __init__(self, num_experts: int = 0, experts_per_token: int = 0, margin: float = 0.05,
                 probe_every: int = 16, explore: float = 0.03, timed: bool = True):
        self.E, self.k, self.timed = num_experts, experts_per_token, timed
        self._unions: dict[int, float] = {}  # T -> union_multiplier (fixed by E and k)
        self.margin, self.probe_every, self.explore = margin, probe_every, explore
        self._fwd: dict[int, RecentMedian] = {}
        self._draft: dict[str, RecentMedian] = {}  # seconds per depth of drafting
        self._acc: dict[str, _Acceptance] = {}
        self._probe_cost: dict[str, RecentMedian] = {}  # extra seconds a probe step cost over a plain one
        self._plain_since_probe = 0
        self._replan_in = 0  # plain steps the last (clearly plain) verdict still stands for
        self._planning = RecentMedian()  # seconds one plan() takes (the stepper times it)
        self._step = 0  # decode steps observed
        self._plain_step = RecentMedian(15)  # seconds of a plain (non-probe) step
        self._realized: dict[str, _Realized] = {}
        self._elapsed = 0.0  # decode seconds so far (steps, in units of t(1) when not timed)
        self._explored = 0.0  # of which spent beyond plain steps on probes
        self._gamma_prior = 1.0 if num_experts else 0.1  # pessimistic until forwards are timed
        self.gamma = self._gamma_prior

    # ---- forward time ----------------------------------------------------------------------------------
    def union(self, T: int) -> float:
        got = self._unions.get(T)
        if got is None:
            got = self._unions[T] = union_multiplier(self.E, self.k, T)
        return got

    def observe_forward(self, T: int, seconds: float) -> None:
        if not self.timed:
            return
        self._fwd.setdefault(T, RecentMedian()).add(seconds)
        self._fit_gamma()

    def _fit_gamma(self) -> None:
        """gamma: the mean of each observed T's own estimate, weighted by how often T was seen (a one-off
        prefill of a long prompt, with its attention and head costs, must not outweigh the decode steps), and
        shrunk towards the prior as if it had been seen GAMMA_PRIOR_WEIGHT times (a few noisy timings of a
        small tree must not make verification look free)."""
        one = self._fwd.get(1)
        if one is None or one.value <= 0:
            return
        num, den = GAMMA_PRIOR_WEIGHT * self._gamma_prior, GAMMA_PRIOR_WEIGHT
        for T, e in self._fwd.items():
            u = self.union(T) - 1.0
            if T > 1 and u > 0:
                w = min(e.count, 8)
                num += w * max(0.0, e.value / one.value - 1.0) / u
                den += w
        self.gamma = num / den

    def forward_time(self, T: int) -> float:
        one = self._fwd.get(1)
        t1 = one.value if one is not None else 1.0
        model = t1 * (1.0 + self.gamma * (self.union(T) - 1.0))
        seen = self._fwd.get(T)
        if T == 1:
            return t1
        if seen is None:
            return min(model, self._extrapolate(T, t1))
        if seen.count >= 4:
            return seen.value
        # seen only a few times: the model, unless those times were lower (one slow step must not rule a tree
        # size out before it has been tried a few times)
        return min(model, seen.value)

    def _extrapolate(self, T: int, t1: float) -> float:
        """Linear in T from the largest smaller tree size seen twice: routing is not independent (a tree of
        repeated tokens routes to the same few experts), so the union model can overstate what an untried
        size costs; the lower of the two is tried, then measured."""
        below = [t for t, e in self._fwd.items() if 1 < t < T and e.count >= 2]
        if not below:
            return float("inf")
        t = max(below)
        slope = max(0.0, self._fwd[t].value - t1) / (t - 1)
        return self._fwd[t].value + slope * (T - t)

    def observe_step(self, seconds: float, plan: "DraftChoice", tokens: int = 1) -> None:
        """One decode step's time and the tokens it emitted; a probe's excess over a plain step is charged to
        the exploration budget, a speculative step to its drafter's realized record."""
        self._step += 1
        t1 = self.forward_time(1)
        seconds = seconds if self.timed else (t1 + (2.0 * t1 if plan.probe else 0.0))
        self._elapsed += seconds
        if plan.probe:
            extra = max(0.0, seconds - t1)
            self._explored += extra
            self._probe_cost.setdefault(plan.drafter, RecentMedian()).add(extra)
        elif plan.drafter is None:
            self._plain_step.add(seconds)
        elif self.timed:
            self._judge(plan.drafter, seconds, tokens)

    def _judge(self, name: str, seconds: float, tokens: int) -> None:
        r = self._realized.setdefault(name, _Realized())
        r.steps = (r.steps + [(seconds, tokens)])[-REALIZED_WINDOW:]
        if len(r.steps) < REALIZED_WINDOW:
            return
        # against the median plain step, or while too few plain steps were timed, the model's own t(1)
        plain = self._plain_step.value if self._plain_step.count >= 4 else self.forward_time(1)
        if r.seconds_per_token() > plain:  # slower than not speculating at all
            r.benched_until, r.bench = self._step + r.bench, 2 * r.bench
            r.steps.clear()
        else:
            r.bench = BENCH_FIRST

    def benched(self, name: str) -> bool:
        r = self._realized.get(name)
        return r is not None and self._step < r.benched_until

    # ---- drafting --------------------------------------------------------------------------------------
    def observe_draft(self, name: str, depth: int, seconds: float) -> None:
        if depth > 0 and self.timed:
            self._draft.setdefault(name, RecentMedian()).add(seconds / depth)

    def draft_time(self, name: str, depth: int, prior_per_depth: float) -> float:
        e = self._draft.get(name)
        return depth * (e.value if e is not None and e.count else prior_per_depth)

    # ---- acceptance ------------------------------------------------------------------------------------
    def acceptance(self, name: str) -> _Acceptance:
        return self._acc.setdefault(name, _Acceptance())

    def observe_ranks(self, name: str, ranks: list[int], widths: list[int]) -> None:
        """ranks[d]: sibling rank accepted at depth d + 1 (-1: none); widths[d]: siblings offered there. An accepted
        token re-plans at once; rejections only lower the drafter's rates, so a plain verdict still stands (a
        shadow-scored n-gram proposal ends on most plain steps of unrepetitive text: re-planning on each cost ~4% of
        a step of the bundled demo model, tools/spec_profile.py)."""
        acc = self.acceptance(name)
        if any(k >= 0 for k in ranks):
            self._replan_in = 0
        for d, (k, w) in enumerate(zip(ranks, widths), start=1):
            for r in range(w if k < 0 else k + 1):
                acc.add(d, r, r == k)

    # ---- the decision ----------------------------------------------------------------------------------
    def observe_planning(self, seconds: float) -> None:
        if self.timed:
            self._planning.add(seconds)

    def _stands_for(self, clear: bool) -> int:
        """Steps a plain verdict stands: a clear one REPLAN_EVERY, a near one 1 (the next step may tip it), either
        more where planning would otherwise take over PLAN_SHARE of the decode time (new acceptance evidence
        still re-plans at once); untimed runs ignore the planning time, reproducibly."""
        least = REPLAN_EVERY if clear else 1
        t1 = self.forward_time(1)
        if not self.timed or self._planning.count == 0 or t1 <= 0:
            return least
        return max(least, math.ceil(self._planning.value / (PLAN_SHARE * t1)))

    def keep_plain(self) -> bool:
        """True while the last verdict, a plain step that every plan lost to by a clear margin, stands: the
        caller then takes a plain step without planning (the step counts towards the next probe as usual)."""
        if self._replan_in <= 0:
            return False
        self._replan_in -= 1
        self._plain_since_probe += 1
        return True

    def plan(self, drafters: dict[str, float], max_depth: int, max_width: int, depth: int | None = None,
             width: int | None = None, shadow: set[str] = frozenset(), catch_up: dict[str, float] | None = None
             ) -> DraftChoice:
        """drafters: name -> prior seconds of drafting per depth. depth / width: user overrides. catch_up:
        name -> estimated seconds its next proposal spends catching up first (MTP after plain steps)."""
        if depth is not None and width is not None and len(drafters) == 1:
            return DraftChoice(next(iter(drafters)), depth, width)
        drafters = {n: p for n, p in drafters.items() if not self.benched(n)}
        plain = 1.0 / max(self.forward_time(1), 1e-9)
        best, best_rate = DraftChoice(None), plain * (1.0 + self.margin) if depth is None else -1.0
        depths = [depth] if depth is not None else range(1, max_depth + 1)
        widths = [width] if width is not None else range(1, max_width + 1)
        top_depth, top_width = max(depths), max(widths)
        verify = {T: self.forward_time(T) for T in {1 + D * W for D in depths for W in widths}}
        near: tuple[float, DraftChoice] = (0.0, DraftChoice(None))  # the best plan of a shadow-scored drafter
        top_rate = 0.0  # the best rate of any speculative plan
        for name, prior in drafters.items():
            acceptance = self.acceptance(name)
            per_depth = self.draft_time(name, 1, prior)
            for W in widths:
                expected = acceptance.expected(top_depth, top_width, W)
                for D in depths:
                    rate = expected[D - 1] / max(D * per_depth + verify[1 + D * W], 1e-9)
                    top_rate = max(top_rate, rate)
                    if rate > best_rate:
                        best, best_rate = DraftChoice(name, D, W), rate
                    if name in shadow and rate > near[0]:
                        near = (rate, DraftChoice(name, D, W, probe=True))
        if best.drafter is not None or depth is not None:
            self._plain_since_probe = 0
            return best
        self._plain_since_probe += 1
        stands = self._stands_for(clear=top_rate < CLEAR_LOSS * plain) - 1
        if self._plain_since_probe < self.probe_every:
            self._replan_in = stands
            return best
        # probe a drafter only if it could win at all (near-perfect acceptance at depth 1), and only while the
        # probes' extra cost stays within `explore` of the decode time so far
        budget = self.explore * self._elapsed - self._explored
        probe = [n for n, prior in drafters.items() if n not in shadow
                 and OPTIMISTIC / max(self.draft_time(n, 1, prior) + self.forward_time(2), 1e-9)
                 > plain * (1.0 + self.margin)
                 and self._probe_estimate(n, prior) + (catch_up or {}).get(n, 0.0) <= budget]
        if probe:
            self._plain_since_probe = 0
            name = min(probe, key=lambda n: self.acceptance(n).observations())
            return DraftChoice(name, 1, 1, probe=True)
        # a shadow-scored drafter that nearly wins is retried now and then: its acceptance is known, but the
        # verification times that rule it out may be a few slow measurements that no step would revisit
        if near[1].drafter is not None and near[0] > NEAR_MISS * best_rate and \
                self.forward_time(1 + near[1].depth * near[1].width) - self.forward_time(1) <= budget:
            self._plain_since_probe = 0
            return near[1]
        # nothing to probe: the verdict stands as any plain one (a drafter that cannot win, or an exhausted
        # exploration budget, used to make every later step plan in full: ~4% of a demo-model step)
        self._replan_in = stands
        return best

    def _probe_estimate(self, name: str, prior: float) -> float:
        """Extra seconds the next probe of `name` will cost: measured, or drafting + verification's excess."""
        seen = self._probe_cost.get(name)
        if seen is not None and seen.count:
            return seen.value
        return 2.0 * (prior + self.forward_time(2) - self.forward_time(1)) + self.forward_time(1)

    def summary(self) -> dict[str, Any]:
        return {"gamma": round(self.gamma, 4), "t1_s": round(self.forward_time(1), 6),
                "forward_s": {T: round(e.value, 6) for T, e in sorted(self._fwd.items())},
                "draft_s_per_depth": {n: round(e.value, 6) for n, e in self._draft.items()},
                "acceptance_d1": {n: round(a.rate(1, 0), 3) for n, a in self._acc.items()}}


def _expected(table: list[list[float]], width: int) -> list[float]:
    """E(D, width) for D = 1 .. len(table): a chain with width - 1 siblings per depth (siblings are leaves)."""
    out, reach, total = [], 1.0, 1.0
    for row in table:
        miss = 1.0
        for r in range(width):
            miss *= 1.0 - row[r]
        total += reach * (1.0 - miss)
        reach *= row[0]
        out.append(total)
    return out


def union_multiplier(num_experts: int, k: int, T: int) -> float:
    """Expected distinct experts per layer for T tokens, relative to one token (independent routing)."""
    if not num_experts or not k:
        return float(T)
    f = k / num_experts
    return union_share(num_experts, k, T) / f if f < 1 else 1.0  # the planner's A7 formula, per routed expert
