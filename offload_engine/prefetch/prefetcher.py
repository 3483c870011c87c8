"""Turns predictions into store prefetches, and measures whether they were right.

Called explicitly from the layer loop (no hooks): `after_attention(l, x)` once layer l's residual stream is
known (predict layers l+1..l+depth, and read ahead their dense units when those are not pinned), and
`routed(l, experts)` once layer l's real routing is known (score the predictions for l, cancel the stale ones
that have not started, feed the frequency prior). Prefetches are best effort: they take only free or evictable
slots, never units in use, and queue behind demand reads in the reader pool.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..checkpoint.naming import UnitKey
from .predictor import ExpertPredictor


@dataclass(frozen=True)
class PrefetchConfig:
    enabled: bool = True
    depth: int = 1  # MoE layers ahead
    margin: int = 2  # candidates beyond top-k per token
    min_prob: float = 0.05
    adaptive: bool = True  # stop expert prefetching when most prefetched units go unused


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


class Prefetcher:
    def __init__(self, store, predictor: ExpertPredictor, moe_layers: list[int], num_layers: int,
                 config: PrefetchConfig):
        self.store, self.predictor, self.config = store, predictor, config
        self.moe_layers, self.num_layers = sorted(moe_layers), num_layers
        self.metrics = PrefetchMetrics()
        self._pending: dict[int, set[int]] = {}  # layer -> experts predicted for it, not yet routed
        self.expert_prefetch = config.enabled
        self._stream_dense = store.placement.home("dense") == "disk"

    def after_attention(self, layer: int, x: torch.Tensor) -> None:
        if not self.config.enabled:
            return
        if self._stream_dense:  # certain: the next layers' dense units (and the head after the last one)
            ahead = [UnitKey(l, "dense") for l in range(layer + 1, min(layer + 1 + self.config.depth,
                                                                       self.num_layers))]
            self.store.prefetch(ahead)
        if not self.expert_prefetch:
            return
        prediction = [(k, p) for k, p in self.predictor.predict(layer, x, self.config.depth)
                      if p >= self.config.min_prob]
        for key, _ in prediction:
            self._pending.setdefault(key.layer, set()).add(key.expert)
        self.store.prefetch([k for k, _ in prediction])

    def routed(self, layer: int, experts: list[int]) -> None:
        self.predictor.observe(layer, experts)
        predicted = self._pending.pop(layer, None)
        if predicted is None:
            return
        actual = set(experts)
        self.metrics.record(layer, predicted, actual)
        self.store.cancel_prefetch([UnitKey(layer, "expert", e) for e in predicted - actual])
        self._adapt()

    def _adapt(self) -> None:
        """FIELD-NOTES: on a link with no spare bandwidth, acting on predictions costs more than it saves."""
        s = self.store.stats
        # measured on a ~450 MB/s disk (docs/PERF.md): with 38% of guesses used, prefetch made decode 2.8x slower
        if self.config.adaptive and s.prefetch_issued >= 32 and s.prefetch_used < 0.5 * s.prefetch_issued:
            self.expert_prefetch = False

    def summary(self) -> dict:
        return {"enabled": self.config.enabled, "expert_prefetch_active": self.expert_prefetch,
                **self.metrics.summary()}
