"""Sampling parameters, the post-processing distribution, and a seeded sampler.

Glossary:
  logits   raw model scores, float tensor [..., V]
  probs    the distribution actually sampled from, after temperature -> top-k -> top-p -> min-p
           (the order transformers' `generate` applies its logits warpers in)

`probabilities` is shared by plain sampling and the speculative verifier (target and draft sides), so it
works on any leading shape and never depends on anything but the logits and the parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError


def _as_tuple(name: str, value: Any, kind: type) -> tuple:
    """Lists (from JSON / CLI) become tuples; a bare string stop becomes a 1-tuple, not a tuple of characters."""
    if isinstance(value, kind) and not isinstance(value, bool):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigError(f"{name} must be a list of {kind.__name__}, got {value!r}") from None
    for item in items:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ConfigError(f"{name} must contain only {kind.__name__} values, got {item!r}")
    return items


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    seed: int | None = None  # None = fresh nondeterministic seed per Sampler
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        if (not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool)
                or self.max_new_tokens < 1):
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        stop = _as_tuple("stop", self.stop, str)
        if any(s == "" for s in stop):
            raise ConfigError("stop strings must be non-empty, got ''")
        stop_ids = _as_tuple("stop_token_ids", self.stop_token_ids, int)
        if any(i < 0 for i in stop_ids):
            raise ConfigError(f"stop_token_ids must be >= 0, got {list(stop_ids)}")
        # frozen dataclass: normalised values go in through object.__setattr__
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_ids)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")


# ---------------------------------------------------------------------------------------------- warpers
# Each takes and returns float32 scores [..., V]; removed entries become -inf. At least one token survives.

def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    # Like TopKLogitsWarper: keep everything >= the k-th largest score, so ties at the boundary all survive.
    k = min(k, scores.shape[-1])
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, -math.inf)


def _top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    # Like TopPLogitsWarper (ascending cumsum, drop where cum <= 1 - p, keep the top one), but with a stable
    # sort arranged so that among equal scores the lowest token id ranks highest: deterministic ties.
    desc_idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    asc_idx = desc_idx.flip(-1)
    asc_scores = scores.gather(-1, asc_idx)
    cum = asc_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1.0 - p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, asc_idx, remove_sorted)
    return scores.masked_fill(remove, -math.inf)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    # Like MinPLogitsWarper: drop tokens with prob < min_p * max prob; the argmax always survives.
    probs = scores.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    remove = probs < threshold
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return scores.masked_fill(remove, -math.inf)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    # torch.argmax returns the first maximal index: lowest id wins ties.
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 scores [..., V] after temperature, top-k, top-p, min-p (filtered entries = -inf).

    Only meaningful for temperature > 0; greedy has no scores to warp.
    """
    scores = logits.float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0:
        scores = _top_k(scores, params.top_k)
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    if params.min_p > 0.0:
        scores = _min_p(scores, params.min_p)
    return scores


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from: float32 [..., V], each row summing to 1.

    temperature 0 -> one-hot of the argmax (lowest index on ties).
    """
    if params.greedy:
        return _one_hot_argmax(logits)
    return processed_logits(logits, params).softmax(dim=-1)


# ---------------------------------------------------------------------------------------------- sampler

class Sampler:
    """Draws tokens from `probabilities`, reproducibly when `params.seed` is set.

    `generator` is public so a speculative verifier draws its acceptance uniforms from the same stream,
    which keeps a seeded run reproducible with speculation on.
    """

    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu"):
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.seed = self.generator.seed()  # fresh nondeterministic seed, kept for reporting
        else:
            self.seed = params.seed
            self.generator.manual_seed(params.seed)

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id."""
        if logits.dim() != 1:
            raise ValueError(f"Sampler.sample expects logits of shape [V], got {tuple(logits.shape)}")
        if self.params.greedy:
            return int(logits.argmax())
        probs = probabilities(logits, self.params).to(self.generator.device)
        return int(torch.multinomial(probs, 1, generator=self.generator))
