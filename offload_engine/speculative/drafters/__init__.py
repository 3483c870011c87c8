"""Drafters: cheap guesses of the next tokens, proposed as a DraftTree for one target forward to verify.

Protocol (`Drafter`):
  propose(context, state, budget) -> DraftTree   context: every committed id, the root (last accepted,
                                                   not yet in the target's cache) last; budget: depth/width
  rewind(n)                                        forget the last n committed ids (the decode loop ended
                                                   before they were emitted); drafters with their own
                                                   cache also resynchronize lazily on the next propose

Implementations: ngram (prompt / context lookup), mtp (the checkpoint's multi-token-prediction layers),
draft (a second, smaller checkpoint), self (the target restricted to the experts resident in the fastest
tier). `TargetState` carries what the target side knows that a drafter may use: the sampling parameters,
the shared random generator, and the target's hidden states for positions the drafter has not seen yet.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from ...generate.sampling import SamplingParams, probabilities
from ..tree import DraftTree


@dataclass(frozen=True)
class DraftBudget:
    depth: int  # longest root-to-leaf path
    width: int = 1  # candidates per depth (1 = a chain)
    max_nodes: int | None = None  # hard cap (cache room); None = depth * width

    @property
    def node_cap(self) -> int:
        """Most nodes a drafter may propose: the cache room's cap, else a full depth x width tree."""
        return self.max_nodes if self.max_nodes is not None else self.depth * self.width


MAX_CHUNKS = 64


@dataclass
class TargetState:
    """Target-side facts shared with drafters. Hidden rows are the trunk's output (before the final norm) for
    consecutive positions `hidden_start` .. `hidden_end` - 1, kept (as appended chunks, so recording one costs
    no copy of the others) until a drafter consumes them, at most `max_hidden` of them: older ones are dropped
    and a drafter that needed them starts over from what is left (MTP: attention over a window)."""

    params: SamplingParams
    generator: torch.Generator
    keep_hidden: bool = False  # whether some drafter wants hidden rows (otherwise none are recorded)
    max_hidden: int = 1024
    _chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list, repr=False)

    @property
    def chunk_count(self) -> int:
        """Chunks the hidden rows are held in: at most MAX_CHUNKS (more are coalesced into one)."""
        return len(self._chunks)

    @property
    def hidden_start(self) -> int:
        return self._chunks[0][0] if self._chunks else 0

    @property
    def hidden_end(self) -> int:
        return self._chunks[-1][0] + self._chunks[-1][1].shape[0] if self._chunks else 0

    def push_hidden(self, start: int, rows: torch.Tensor) -> None:
        """Record trunk rows for positions start .. start + len(rows) - 1 (replacing any from `start` on)."""
        if not self.keep_hidden:
            return
        if self._chunks and start > self.hidden_end:
            raise ValueError(f"hidden rows for position {start} leave a gap after {self.hidden_end}")
        if start == self.hidden_end:  # the usual case, the next positions: O(1) while drafters stay idle
            self._chunks.append((start, rows.detach()))
        else:
            self._chunks = [(s, r[:start - s]) for s, r in self._chunks if s < start] + [(start, rows.detach())]
        if len(self._chunks) > MAX_CHUNKS:  # one copy now and then keeps trimming and taking O(MAX_CHUNKS)
            self._chunks = [(self.hidden_start, torch.cat([r for _, r in self._chunks]))]
        excess = self.hidden_end - self.hidden_start - self.max_hidden
        if excess > 0:
            self._drop_before(self.hidden_start + excess)

    def take_hidden(self, start: int, end: int) -> torch.Tensor:
        """Rows for positions start .. end - 1; rows before `start` are dropped (consumed)."""
        if not self._chunks or start < self.hidden_start or end > self.hidden_end:
            raise ValueError(f"hidden rows for positions [{start}, {end}) are not recorded "
                             f"(have [{self.hidden_start}, {self.hidden_end}))")
        self._drop_before(start)
        parts = [r[max(0, start - s):end - s] for s, r in self._chunks if s < end]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _drop_before(self, position: int) -> None:
        self._chunks = [(max(s, position), r[max(0, position - s):]) for s, r in self._chunks
                        if s + r.shape[0] > position]


class Drafter(Protocol):
    """Optional attributes the stepper reads: `free = True` (proposals cost nothing: scored in the shadow of
    plain steps instead of probed), `pending(context_len)` (positions the next proposal must catch up on first)
    and `catch_up_s` (the last proposal's time doing so: a one-off, not the per-step price)."""

    name: str
    needs_hidden: bool  # wants TargetState hidden rows (MTP)

    def propose(self, context: Sequence[int], state: TargetState, budget: DraftBudget) -> DraftTree: ...

    def rewind(self, n: int) -> None: ...


def top_candidates(logits: torch.Tensor, state: TargetState, width: int) -> tuple[list[int], torch.Tensor | None, bool]:
    """A drafter's candidates at one depth from its logits [V]: (tokens, q row, first token drawn from q).

    Greedy: the top `width` tokens by logit, deterministic. Sampling: the first token drawn from
    q = probabilities(logits) with the shared generator, then the most probable others, deterministic."""
    if state.params.greedy:
        return logits.topk(min(width, logits.shape[-1])).indices.tolist(), None, False
    q = probabilities(logits, state.params)
    first = int(torch.multinomial(q.to(state.generator.device), 1, generator=state.generator))
    tokens = [first]
    if width > 1:
        for t in q.topk(min(width, q.shape[-1])).indices.tolist():
            if t != first and len(tokens) < width and q[t] > 0:
                tokens.append(t)
    return tokens, q, True
