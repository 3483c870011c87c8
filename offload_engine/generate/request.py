"""A request checked once: Engine.prepare turns a prompt and its arguments into a PreparedRequest, which
Engine.stream / generate (and the server's worker) run as is, without checking it again.

What prepare checks, in this order (each refusal a ConfigError naming the argument as the API spells it):
the sampling values (SamplingParams), logit_bias ids against the vocabulary, the prompt's ids, the speculation
mode and draft shape, the grammar (compiled against the tokenizer), a mode this engine cannot run (MTP layers not
loaded, no draft model, self drafting on a model without routed experts or on a pipeline stage), and prompt + max_new_tokens against the context the engine reserved. Agreement of a
draft model's vocabulary with the target's is a property of the engine, checked once when it opens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .grammar import GrammarMatcher
from .sampling import SamplingParams


class RequestError(ConfigError):
    """A request argument Engine.prepare refuses: `field` names it ("prompt", "spec", "context": prompt +
    max_new_tokens), so that a caller such as the server can answer in its own words; str() is the API's message."""

    def __init__(self, message: str, field: str, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = code


@dataclass(frozen=True)
class PreparedRequest:
    """A prompt and its arguments, checked against one engine (`owner`): stream(request) / generate(request)
    run it any number of times (a seeded one gives the same tokens each time), on that engine only."""

    ids: tuple[int, ...]
    params: SamplingParams
    spec: str  # the speculation mode it runs with (the engine's default when none was asked for)
    spec_depth: int | None = None
    spec_width: int | None = None
    owner: object = field(default=None, compare=False, repr=False)
    # the grammar state built while checking the grammar: the first run takes it, later runs build their own
    _constraint: list = field(default_factory=list, compare=False, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    def constraint(self, tokenizer: Any, vocab_size: int) -> GrammarMatcher | None:
        """This run's grammar state (a GrammarMatcher follows one sequence), or None without a grammar."""
        if self.params.grammar is None:
            return None
        if self._constraint:
            return self._constraint.pop()
        return GrammarMatcher(self.params.grammar, tokenizer, vocab_size)


def check_prompt(prompt_ids: Any, vocab_size: int) -> list[int]:
    """The prompt's ids as ints, each in the vocabulary, at least one."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise RequestError("prompt is empty: give at least one token (e.g. the BOS token)", "prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}", "prompt")
    return prompt


def check_context(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    if prompt_tokens + max_new_tokens > context:
        raise RequestError(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceed the context "
                           f"this engine reserved in its budget ({context} tokens): open it with a larger "
                           f"max_context (--context)", "context", code="context_length_exceeded")


def check_runnable(mode: str, has_mtp: bool, has_draft: bool, no_self: str | None = None) -> None:
    """A mode this engine cannot run: its MTP layers were not loaded, it was opened without a draft model, or
    (`no_self`: why, speculative/drafters/factory.self_draft_refusal) the self drafter cannot run on its model."""
    if mode == "mtp" and not has_mtp:
        raise RequestError("spec 'mtp': this engine was opened without the checkpoint's MTP layers; open it with "
                           "spec='mtp' (spec='auto' loads them only where they cost little memory)", "spec")
    if mode == "draft" and not has_draft:
        raise RequestError("spec 'draft': this engine was opened without a draft model; open it with "
                           "draft_model=DIR", "spec")
    if mode == "self" and no_self is not None:
        raise RequestError(f"spec 'self': {no_self}", "spec")
