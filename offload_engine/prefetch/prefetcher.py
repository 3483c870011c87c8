"""Turns predictions into store prefetches, and measures whether they were right.

Called explicitly from the layer loop (no hooks): `after_attention(l, x)` once layer l's residual stream is
known (predict layers l+1..l+depth, and read ahead their dense units when those are not pinned), and
`routed(l, experts)` once layer l's real routing is known (score the predictions for l, cancel the stale ones
that have not started, feed the frequency prior). Prefetches are best effort: they take only free or evictable
slots, never units in use, and queue behind demand reads in the reader pool.

Dense units are read one layer further ahead than experts are predicted: their use is certain, and the router
lookahead needs layer t's dense unit (its router) resident when layer t - 1 asks for a prediction.

Expert prefetching must pay in seconds (FIELD-NOTES: on a link with no spare bandwidth, wrong guesses delay the
right reads). `PayCheck` measures it: trials of single-token forwards with expert prefetching on, then off, keep
whichever was faster for a hold period (doubled while the verdict repeats), then trial again. Wrong guesses
must not push out cached experts the next tokens would have hit (at a 94% hit rate that pollution tripled the
bytes read per token): a prefetch evicts a cached expert (one unused through the whole previous forward) only
while fewer than `slots` slots hold unjudged or wrong guesses, and otherwise recycles a wrong guess's slot;
`routed` marks wrong guesses stale, the first victims of every read. And at most `reads` guesses per token are
read at each layer, the likeliest first: on a link with no spare bandwidth each wrong one delays a demand read.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..checkpoint.naming import UnitKey
from ..config import PrefetchConfig
from .predictor import ExpertPredictor


@dataclass
class PrefetchMetrics:
    predicted: int = 0
    routed: int = 0
    hit: int = 0  # routed experts that had been predicted
    per_layer: dict[int, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))

    def record(self, layer: int, predicted: set[int], routed: set[int]) -> None:
        hit = len(predicted & routed)
        self.predicted += len(predicted)
        self.routed += len(routed)
        self.hit += hit
        row = self.per_layer[layer]
        row[0] += len(predicted)
        row[1] += len(routed)
        row[2] += hit

    def summary(self) -> dict:
        def ratio(a: int, b: int) -> float:
            return a / b if b else 0.0
        return {"precision": ratio(self.hit, self.predicted), "recall": ratio(self.hit, self.routed),
                "per_layer": {l: {"precision": ratio(h, p), "recall": ratio(h, r)}
                              for l, (p, r, h) in sorted(self.per_layer.items())}}


class PayCheck:
    """Whether expert prefetching pays, by measuring single-token forwards (each from its start to its end: the
    time between forwards is the caller's, a slow consumer of the stream or other work in its thread, and must
    not count) in trials: TRIAL with it on and TRIAL with it off, in turns starting with
    on, then with off (so a drift over a trial, such as the cache warming, favours neither); the lower median
    wins and holds for `hold` forwards, doubled (up to MAX_HOLD) each time a trial repeats the verdict. On must
    beat off by MARGIN: prefetching costs reads, memory bandwidth and compute-thread time, so it must show a gain
    larger than the noise of four forwards (on this project's VM single forwards vary by 10-15%; a false "on"
    held through a 32-token bench run read 27 MB/token of wrong guesses, and that run took 1.61x the bound)."""

    TRIAL, HOLD, MAX_HOLD = 4, 32, 512
    MARGIN = 0.05  # on's median forward must be this much shorter than off's

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.on = True  # expert prefetching for the forward now running
        self.verdicts: list[bool] = []  # each trial's outcome, in order (reported in the stats)
        self._phase = "first"  # "first" / "second": the two halves of a trial; "hold": the verdict stands
        self._first = True  # the setting the current trial times first
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._hold, self._left = self.HOLD, 0
        self._started: float | None = None  # start of the single-token forward running now

    def forward_started(self, tokens: int) -> bool:
        """Called as each forward starts; returns whether it prefetches experts."""
        if tokens == 1:
            self._advance()
        self._started = self.clock() if tokens == 1 else None  # prefill and verification passes are not timed
        return self.on

    def forward_finished(self) -> None:
        """Called as each forward ends (a forward that raised is simply not timed)."""
        if self._started is not None and self._phase != "hold":
            self._times[self.on].append(self.clock() - self._started)
        self._started = None

    def _advance(self) -> None:
        if self._phase == "hold":
            self._left -= 1
            if self._left <= 0:
                self._first = not self._first
                self._phase, self.on = "first", self._first
                self._times = {True: [], False: []}
        elif len(self._times[self.on]) >= self.TRIAL:
            if self._phase == "first":
                self._phase, self.on = "second", not self.on
            else:
                verdict = (statistics.median(self._times[True])
                           < (1 - self.MARGIN) * statistics.median(self._times[False]))
                self._hold = min(2 * self._hold, self.MAX_HOLD) if self.verdicts[-1:] == [verdict] else self.HOLD
                self.verdicts.append(verdict)
                self._phase, self.on, self._left = "hold", verdict, self._hold


# Forwards of at most this many tokens route ahead (decode, speculative verification). A prefill routes its
# tokens to most experts of every layer: its waits are for reads of its own layer, and a guess adds little.
ROUTE_AHEAD_TOKENS = 16


class Prefetcher:
    def __init__(self, store, predictor: ExpertPredictor, moe_layers: list[int], num_layers: int,
                 config: PrefetchConfig, first_layer: int = 0):
        """num_layers: the end of the layers this store holds; first_layer: their start (a pipeline stage's
        layers, checkpoint/stage.py; 0 and the model's layer count otherwise)."""
        self.store, self.predictor, self.config = store, predictor, config  # config.slots: the store's own quota
        self.moe_layers, self.num_layers = sorted(moe_layers), num_layers
        self.first_layer = first_layer
        self.metrics = PrefetchMetrics()
        self._pending: dict[int, set[int]] = {}  # layer -> experts predicted for it, not yet routed
        self._ahead: dict[int, set[int]] = {}  # layer -> experts its routing computed ahead named (routed_ahead)
        self.ahead_metrics = PrefetchMetrics()
        self.expert_prefetch = config.enabled
        self.pay = PayCheck() if config.adaptive else None
        self._stream_dense = store.placement.home("dense") == "disk"
        self._forward_ticks = (0, 0)  # store ticks at the start of the previous and of the current forward
        self._forwards = [0, 0]  # forwards so far, of which with expert prefetching on

    def after_attention(self, layer: int, x: torch.Tensor) -> None:
        if not self.config.enabled:
            return
        if layer == self.first_layer:
            self._forward_ticks = (self._forward_ticks[1], self.store.tick)
            if self.pay is not None:
                self.expert_prefetch = self.pay.forward_started(x.shape[0])
            self._forwards[0] += 1
            self._forwards[1] += self.expert_prefetch
        if self._stream_dense:  # certain: the next layers' dense units, one layer beyond the expert horizon
            ahead = [UnitKey(l, "dense") for l in range(layer + 1, min(layer + 2 + self.config.depth,
                                                                       self.num_layers))]
            self.store.prefetch(ahead)
        if not self.expert_prefetch or self.routes_ahead(x.shape[0]):
            # a forward that routes ahead reads the experts that predictor names instead: on the experts that
            # miss (those the previous token did not use) the lookahead's precision was 22% against route
            # ahead's 84%, and its reads doubled the bytes read per token (bench model, 25%: 27 -> 59 MB, 66 ->
            # 75 ms/token, same prompts; route ahead alone 66 ms). It still reads ahead for larger forwards.
            return
        prediction = [(k, p) for k, p in self.predictor.predict(layer, x, self.config.depth)
                      if p >= self.config.min_prob]
        for key, _ in prediction:
            self._pending.setdefault(key.layer, set()).add(key.expert)
        self.store.prefetch([k for k, _ in prediction], used_before=self._forward_ticks[0],
                            limit=self.config.reads * x.shape[0])

    def forward_finished(self) -> None:
        if self.pay is not None:
            self.pay.forward_finished()

    def routes_ahead(self, tokens: int) -> int:
        """How many next layers' routing a forward of `tokens` tokens predicts while a layer waits for reads
        (CausalLM._route_ahead); such a forward reads no lookahead guesses (after_attention). Part of expert
        prefetching, so the pay check switches it: it runs in time the compute thread would wait anyway and its
        reads are mostly right (77% used on the bench model at 25%), but each read still evicts a cached expert
        and takes the disk from demand reads. On this project's CPU VM it about broke even (25%, same prompts,
        six alternating runs: 66.4 -> 66.3 ms/token, +1.8 MB read per token); where compute is fast next to the
        disk, every layer waits and the earlier reads should pay."""
        on = self.config.enabled and self.expert_prefetch and tokens <= ROUTE_AHEAD_TOKENS
        return self.config.route_ahead if on else 0

    def resident_weights(self, key: UnitKey):
        """A unit's weights if resident (no read): what computing a routing ahead may use."""
        return self.store.peek(key)

    def routed_ahead(self, layer: int, experts: list[int]) -> None:
        """Layer `layer`'s routing as predicted by a layer before it (CausalLM._route_ahead): read its experts
        now, under the rules of every prefetch (Evictor.reserve: only into slots unused since the previous
        forward began, within the quota of unjudged guesses). A wrong guess is cancelled or marked stale by
        `routed`."""
        self._ahead.setdefault(layer, set()).update(experts)
        self.store.prefetch([UnitKey(layer, "expert", e) for e in experts], used_before=self._forward_ticks[0])

    def routed(self, layer: int, experts: list[int]) -> None:
        self.predictor.observe(layer, experts)
        actual, wrong = set(experts), set()
        for guesses, metrics in ((self._pending, self.metrics), (self._ahead, self.ahead_metrics)):
            predicted = guesses.pop(layer, None)
            if predicted is not None:
                metrics.record(layer, predicted, actual)
                wrong |= predicted - actual
        if wrong:
            self.store.cancel_prefetch([UnitKey(layer, "expert", e) for e in sorted(wrong)])

    def snapshot(self) -> dict:
        metrics = self.metrics.summary()
        on_share = self._forwards[1] / self._forwards[0] if self._forwards[0] else 0.0
        # recall / precision score the lookahead in the forwards that ran it (those that do not route ahead: 0.0
        # after a request of short forwards only), over routed experts, resident ones included; the share of
        # expert reads made ahead (the planner's recall) is the store's expert_reads (Engine stats)
        return {"enabled": self.config.enabled, "expert_prefetch_active": self.expert_prefetch,
                "pay_check_verdicts": list(self.pay.verdicts) if self.pay else None,
                "forwards_with_expert_prefetch": on_share, **metrics,
                "route_ahead": {k: v for k, v in self.ahead_metrics.summary().items() if k != "per_layer"}}

