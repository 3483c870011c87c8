"""Sampling parameters, the post-processing distribution, and a seeded sampler.

Glossary:
  logits   raw model scores, float tensor [..., V]
  adjusted logits + logit_bias - penalties (presence / frequency, over the tokens generated so far), the
           scores greedy takes the argmax of and the warpers start from (OpenAI's / vLLM's order)
  probs    the distribution actually sampled from, after temperature -> top-k -> top-p -> min-p
           (the order transformers' `generate` applies its logits warpers in)
  logprobs log_softmax of the model's raw logits (before bias, penalties and warpers, as vLLM reports them),
           recorded per accepted token when asked for

`probabilities` is shared by plain sampling and the speculative verifier (target and draft sides), so it
works on any leading shape and never depends on anything but the logits and the parameters.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..errors import ConfigError
from .grammar import Grammar, GrammarMatcher, as_grammar


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
    presence_penalty: float = 0.0  # subtracted once from each token already generated, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence of each token already generated, in [-2, 2]
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()  # token id -> bias in [-100, 100]
    logprobs: int | None = None  # None: none recorded; k: the chosen token's and the k most likely (k <= 20)
    grammar: Grammar | str | dict | None = None  # output constraint: a Grammar, Lark text, or a JSON schema

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {value}")
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "logit_bias", _check_bias(self.logit_bias))
        object.__setattr__(self, "grammar", as_grammar(self.grammar))
        if self.grammar is not None and self.ignore_eos:
            raise ConfigError("grammar with ignore_eos: the output ends at the EOS token where the grammar completes")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ConfigError(f"logprobs must be None or an integer from 0 to {MAX_TOP_LOGPROBS}, got "
                              f"{self.logprobs!r}")
        # frozen dataclass: normalised values go in through object.__setattr__
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_ids)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """A logit_bias id outside the model's vocabulary is refused before generation starts."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ConfigError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before the warpers (bias or penalties)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


MAX_TOP_LOGPROBS = 20


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")


def _check_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids may be decimal strings, as JSON keys are) -> sorted ((id, bias), ...)."""
    try:
        items = [(key, value) for key, value in (bias.items() if isinstance(bias, Mapping) else bias)]
    except (TypeError, ValueError):
        raise ConfigError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    out = {}
    for key, value in items:
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        _check_number(f"logit_bias[{key}]", value)
        if not -100.0 <= value <= 100.0:
            raise ConfigError(f"logit_bias[{key}] must be in [-100, 100], got {value}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


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


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, histories: Sequence[Sequence[int]]
                    ) -> torch.Tensor:
    """float32 logits [R, V] + logit_bias - penalties, row r penalised by the tokens in histories[r] (the tokens
    generated before that row's position: a list, or a Counter of them). A bias on an id outside the vocabulary is
    refused here."""
    scores = logits.float().clone()
    V = scores.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=scores.device)
        if int(ids.max()) >= V:
            raise ConfigError(f"logit_bias: token id {int(ids.max())} is outside the vocabulary [0, {V})")
        scores[..., ids] += torch.tensor([b for _, b in params.logit_bias], device=scores.device)
    if params.presence_penalty or params.frequency_penalty:
        for r, history in enumerate(histories):
            counts = history if isinstance(history, Counter) else Counter(history)
            if not counts:
                continue
            ids = torch.tensor(list(counts), dtype=torch.long, device=scores.device)
            n = torch.tensor(list(counts.values()), dtype=torch.float32, device=scores.device)
            scores[r, ids] -= params.frequency_penalty * n + params.presence_penalty
    return scores


@dataclass(frozen=True)
class TokenLogprob:
    """One accepted token's log-probability and the most likely alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits [R, V] (row r scored tokens[r]) -> one TokenLogprob per row; ties rank the lower id first."""
    logp = torch.log_softmax(logits.float(), dim=-1).cpu()
    out = []
    for r, token in enumerate(tokens):
        best: tuple[tuple[int, float], ...] = ()
        if top:
            order = torch.sort(logp[r], descending=True, stable=True).indices[:top]
            best = tuple((int(i), float(logp[r, i])) for i in order)
        out.append(TokenLogprob(int(token), float(logp[r, token]), best))
    return out


# ---------------------------------------------------------------------------------------------- sampler

class Sampler:
    """Draws tokens from `probabilities`, reproducibly when `params.seed` is set.

    `generator` is public so a speculative verifier draws its acceptance uniforms from the same stream,
    which keeps a seeded run reproducible with speculation on. A grammar (params.grammar) needs its `constraint`,
    the GrammarMatcher built with the model's tokenizer: `adjust` applies its mask after the bias and penalties.

    It also keeps what depends on the tokens accepted so far: their counts (the penalties') and, when
    params.logprobs is set, one TokenLogprob per accepted token in `logprobs`. A speculative stepper that
    accepts tokens without `sample` reports them with `accept`, and scores a draft tree's rows with `adjust`.
    """

    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu",
                 constraint: GrammarMatcher | None = None):
        if params.grammar is not None and constraint is None:
            raise ConfigError("grammar: the sampler needs its GrammarMatcher (built with the model's tokenizer; "
                              "Engine.stream builds it)")
        self.params = params
        self.constraint = constraint
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.seed = self.generator.seed()  # fresh nondeterministic seed, kept for reporting
        else:
            self.seed = params.seed
            self.generator.manual_seed(params.seed)
        self._counts: Counter[int] = Counter()  # the accepted tokens, for the penalties
        self.logprobs: list[TokenLogprob] = []

    def adjust(self, logits: torch.Tensor, paths: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """logits [R, V] -> adjusted logits (bias, penalties, the grammar's mask); row r continues the accepted
        tokens + paths[r] (None: every row continues the accepted tokens). Unchanged (the same tensor) when there
        is nothing to adjust."""
        paths = paths if paths is not None else [()] * logits.shape[0]
        scores = logits
        if self.params.adjusts:
            scores = adjusted_logits(logits, self.params, [self._counts + Counter(p) if p else self._counts
                                                          for p in paths])
        if self.constraint is not None:
            scores = self.constraint.mask(scores.float(), paths)
        return scores

    def accept(self, tokens: Sequence[int], logits: torch.Tensor) -> None:
        """Record accepted tokens (the grammar takes them too); logits [len(tokens), V] are the raw rows that scored
        them. A speculative verifier calls it for the tokens it accepted without `sample`."""
        if self.constraint is not None:
            self.constraint.advance(tokens)
        if self.params.logprobs is not None:
            self.logprobs.extend(token_logprobs(logits, tokens, self.params.logprobs))
        self._counts.update(int(t) for t in tokens)

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id (accepted: counted for the penalties, its logprob recorded)."""
        if logits.dim() != 1:
            raise ValueError(f"Sampler.sample expects logits of shape [V], got {tuple(logits.shape)}")
        scores = self.adjust(logits[None])[0]
        if self.params.greedy:
            token = int(scores.argmax())
        else:
            probs = probabilities(scores, self.params).to(self.generator.device)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        self.accept([token], logits[None])
        return token
