"""The decode loop: prompt ids in, a stream of typed events out.

Glossary:
  prefill     one forward over the whole prompt; only its last row of logits is used
  step        one call that turns the last accepted token into the next accepted token(s); plain decoding
              accepts exactly one per step, a speculative stepper (later) accepts one or more
  state       per-request bookkeeping (ids, text, stop conditions, what may be streamed yet), shared by
              every stepper so stopping behaves the same with and without speculation

Seam for speculative decoding: implement the `Stepper` protocol (prefill + step returning several ids,
rewinding its own cache on rejections) and pass it to `drive`; `GenerationState` stops mid-list when an
accepted token ends generation, and `drive` calls `stepper.finish` so the stepper can trim what was left.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import torch

from ..errors import ConfigError
from ..tokenizer import StreamDecoder, Tokenizer
from .request import check_prompt
from .sampling import Sampler, SamplingParams, TokenLogprob


@dataclass
class TokenEvent:
    """One generated token and the text it completed (may be '' while text is held back)."""

    token_id: int
    text: str
    logprob: TokenLogprob | None = None  # when the sampling params ask for logprobs


@dataclass
class FinishEvent:
    """The last event of a stream."""

    reason: str  # "eos" | "stop" | "length"
    token_ids: list[int]  # every generated id, including a final EOS id (as transformers returns it)
    text: str  # the generated text: no EOS text, cut before a stop string
    prefill_tokens: int
    prefill_s: float
    decode_s: float
    stats: dict[str, Any] = field(default_factory=dict)  # filled in by the engine
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the sampling params ask for them

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(len(self.token_ids) - 1, 0)  # the first token comes from prefill
        return steps / self.decode_s if self.decode_s > 0 else 0.0


Event = TokenEvent | FinishEvent


class CausalLMLike(Protocol):
    vocab_size: int

    def new_cache(self, max_tokens: int) -> Any: ...

    def forward(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------- state

@dataclass
class GenerationState:
    """Accepts generated ids one at a time and decides what to stream and when to stop."""

    params: SamplingParams
    tokenizer: Tokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    _emitted: int = field(default=0, init=False, repr=False)  # len of text already streamed
    _end_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)
    _stream: StreamDecoder | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer; pass one or use stop_token_ids")
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None and not self.params.ignore_eos \
            else frozenset()
        # stop_token_ids are explicit requests, so ignore_eos does not cancel them (vLLM's semantics)
        self._end_ids = frozenset(eos) | frozenset(self.params.stop_token_ids)
        self._stream = self.tokenizer.stream_decoder() if self.tokenizer is not None else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def _holdback(self) -> int:
        # a stop string may still be completing in the last (longest - 1) characters
        return max((len(s) for s in self.params.stop), default=1) - 1

    def add(self, token_id: int) -> TokenEvent:
        """Record one generated id; sets finish_reason when it ends the generation."""
        if self.finished:
            raise RuntimeError("GenerationState.add called after the generation finished")
        self.token_ids.append(token_id)
        if token_id in self._end_ids:
            self.finish_reason = "eos"
            self._append_text(self._flush())  # the EOS text itself is never decoded
        else:
            self._append_text(self._push(token_id))
            if not self.finished and len(self.token_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                self._append_text(self._flush())
        return TokenEvent(token_id, self._take_streamable())

    def _append_text(self, new: str) -> None:
        """Add text, then cut at the first stop string that the new text completes."""
        if not new or self.finish_reason == "stop":
            return
        start = max(0, len(self.text) - self._holdback)
        self.text += new
        cut = _find_first(self.text, self.params.stop, start)
        if cut is not None:
            self.text = self.text[:cut]
            self.finish_reason = "stop"

    def _take_streamable(self) -> str:
        end = len(self.text) if self.finished else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def _push(self, token_id: int) -> str:
        return self._stream.push(token_id) if self._stream is not None else ""

    def _flush(self) -> str:
        return self._stream.flush() if self._stream is not None else ""


def _find_first(text: str, stops: Sequence[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


# ---------------------------------------------------------------------------------------------- steppers

class Stepper(Protocol):
    """Produces accepted tokens. Plain decoding: one per step. Speculative: one or more per step."""

    def prefill(self, prompt_ids: list[int]) -> list[int]: ...

    def step(self, last_token: int) -> list[int]: ...

    def finish(self, unused: int) -> None:
        """Called once at the end with how many returned ids were not consumed (rewind point)."""
        ...


class PlainStepper:
    """Target model only: forward the last token, sample the next."""

    def __init__(self, model: CausalLMLike, cache: Any, sampler: Sampler):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self._device = getattr(model, "device", None)

    def prefill(self, prompt_ids: list[int]) -> list[int]:
        return [self.sampler.sample(self.next_logits(prompt_ids))]

    def step(self, last_token: int) -> list[int]:
        return [self.sampler.sample(self.next_logits([last_token]))]

    def finish(self, unused: int) -> None:
        pass  # plain steps never return ids that go unused

    @torch.inference_mode()
    def next_logits(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` to the cache; logits [V] predicting the token after the last of them (the head runs on
        the last position only: a prompt's other rows would cost P x vocab x hidden products and P x vocab floats)."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self._device)
        return self.model.forward(ids, self.cache, last_only=True)[-1]


# ---------------------------------------------------------------------------------------------- loop

def drive(stepper: Stepper, prompt_ids: list[int], state: GenerationState) -> Iterator[Event]:
    """Run a stepper to completion, streaming one TokenEvent per accepted id, then a FinishEvent.

    Timing counts only the stepper's own work, not the time the consumer holds the generator suspended.
    """
    prefill_s = decode_s = 0.0
    unused = 0
    sampler = getattr(stepper, "sampler", None)  # its logprobs: one per accepted token, in order
    records = sampler.logprobs if sampler is not None and sampler.params.logprobs is not None else None
    try:
        start = time.perf_counter()
        pending = stepper.prefill(prompt_ids)
        prefill_s = time.perf_counter() - start
        while True:
            for i, token in enumerate(pending):
                event = state.add(token)
                if records is not None:
                    event.logprob = records[len(state.token_ids) - 1]
                yield event
                if state.finished:
                    unused = len(pending) - i - 1
                    break
            if state.finished:
                break
            start = time.perf_counter()
            pending = stepper.step(pending[-1])
            decode_s += time.perf_counter() - start
    finally:
        stepper.finish(unused)  # also runs when the consumer closes the generator early
    yield FinishEvent(reason=state.finish_reason or "length", token_ids=list(state.token_ids), text=state.text,
                      prefill_tokens=len(prompt_ids), prefill_s=prefill_s, decode_s=decode_s,
                      logprobs=None if records is None else records[:len(state.token_ids)])


def decode_stream(model: CausalLMLike, prompt_ids: Sequence[int], params: SamplingParams,
                  tokenizer: Tokenizer | None, cache: Any = None) -> Iterator[Event]:
    """Plain decoding: TokenEvent per generated token, then one FinishEvent.

    Arguments are checked here, eagerly, so a bad request fails at the call rather than at the first next().
    """
    prompt = check_prompt(prompt_ids, model.vocab_size)
    state = GenerationState(params, tokenizer)
    if cache is None:
        cache = model.new_cache(len(prompt) + params.max_new_tokens)
    stepper = PlainStepper(model, cache, Sampler(params))
    return drive(stepper, prompt, state)
