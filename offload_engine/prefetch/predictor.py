"""Expert predictors: one protocol, several estimates of P(expert e of layer t is routed next).

- RouterLookahead applies layer t's own router (after its post-attention norm) to the hidden state leaving
  layer l < t. Published recall for t = l + 1: 88.6% of routed experts on Qwen3-30B-A3B (FIELD-NOTES).
- FrequencyPrior counts how often each expert of each layer was routed in this run (optionally seeded from a
  saved trace): a static hot list predicts about as well as the previous token's experts.
- Combined ranks by 1 - (1 - p_lookahead)(1 - p_prior): either source alone can justify a read.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..checkpoint.naming import UnitKey
from ..errors import ConfigError

Prediction = list[tuple[UnitKey, float]]


class ExpertPredictor(Protocol):
    def predict(self, layer: int, hidden: torch.Tensor, horizon: int) -> Prediction: ...
    def observe(self, layer: int, experts: list[int]) -> None: ...


class RouterLookahead:
    """`dense_weights(t)` returns layer t's dense unit if it is resident (else None: no I/O to predict I/O)."""

    def __init__(self, ops, moe_layers: list[int], top_k: int, margin: int,
                 dense_weights: Callable[[int], dict | None]):
        self.ops, self.moe_layers, self.top_k, self.margin = ops, sorted(moe_layers), top_k, margin
        self.dense_weights = dense_weights

    def predict(self, layer: int, hidden: torch.Tensor, horizon: int) -> Prediction:
        out: Prediction = []
        for target in [t for t in self.moe_layers if t > layer][:horizon]:
            w = self.dense_weights(target)
            if w is None:
                continue
            h = self.ops.post_norm(target, w, hidden)
            scores = self.ops.router_scores(target, w, h)  # [T, E]
            # P(e routed for some token) ~ the max over tokens of its normalized rank score
            probs = (scores / scores.max(dim=-1, keepdim=True).values.clamp_min(1e-12)).max(dim=0).values
            n = min(probs.numel(), (self.top_k + self.margin) * max(1, hidden.shape[0]))
            top = torch.topk(probs, n)
            out += [(UnitKey(target, "expert", int(e)), float(p)) for p, e in zip(top.values, top.indices)]
        return out

    def observe(self, layer: int, experts: list[int]) -> None:
        pass


class FrequencyPrior:
    def __init__(self, moe_layers: list[int], top_k: int, trace: Path | None = None):
        self.moe_layers, self.top_k = sorted(moe_layers), top_k
        self.counts: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.steps: dict[int, int] = defaultdict(int)
        if trace is not None:
            self.load(trace)

    def load(self, path: Path) -> None:
        """A routing trace written by `tools/trace_experts.py record`: {"steps": [[layer, [[expert, ...] per
        token]], ...]}; each token's routing counts as one step of its layer."""
        try:
            data = json.loads(Path(path).read_text())
            steps = data["steps"]
            if not isinstance(steps, list) or not all(isinstance(s, list) and len(s) == 2 and isinstance(s[1], list)
                                                      for s in steps):
                raise ValueError('"steps" is not a list of [layer, [[expert, ...] per token]] pairs')
            for layer, per_token in steps:
                for token in per_token:
                    self.observe(int(layer), [int(e) for e in token])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--trace {path}: not a routing trace of tools/trace_experts.py record "
                              f"({type(e).__name__}: {e})") from e

    def observe(self, layer: int, experts: list[int]) -> None:
        self.steps[layer] += 1
        for e in experts:
            self.counts[layer][e] += 1

    def predict(self, layer: int, hidden: torch.Tensor, horizon: int) -> Prediction:
        out: Prediction = []
        for target in [t for t in self.moe_layers if t > layer][:horizon]:
            steps = self.steps[target]
            if not steps:
                continue
            ranked = sorted(self.counts[target].items(), key=lambda kv: (-kv[1], kv[0]))[: 2 * self.top_k]
            out += [(UnitKey(target, "expert", e), min(1.0, c / steps)) for e, c in ranked]
        return out


class Combined:
    def __init__(self, *predictors: ExpertPredictor):
        self.predictors = predictors

    def observe(self, layer: int, experts: list[int]) -> None:
        for p in self.predictors:
            p.observe(layer, experts)

    def predict(self, layer: int, hidden: torch.Tensor, horizon: int) -> Prediction:
        miss: dict[UnitKey, float] = {}
        for p in self.predictors:
            for key, prob in p.predict(layer, hidden, horizon):
                miss[key] = miss.get(key, 1.0) * (1.0 - prob)
        return sorted(((k, 1.0 - m) for k, m in miss.items()), key=lambda kp: (-kp[1], kp[0]))
