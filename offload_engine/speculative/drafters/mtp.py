"""Drafting with the checkpoint's own multi-token-prediction layers (runtime/mtp.py: DeepSeek-V3 and Qwen3-Next /
Qwen3.5 formats alike), chained for depth > 1.

Layer k's cache holds one entry per position p >= k + 1: (token t_p, previous depth's output at p - 1), the
previous depth of layer 0 being the target's final-normed hidden state. Entries up to the root's position n
use committed tokens only ("real"); they are appended as the target commits tokens (its hidden rows arrive
through TargetState). Drafting then appends "draft" entries that depend on drafted tokens, as transformers'
MtpModel.forward does with its rolled inputs: depth 1 comes from layer 0's real entry at n; depth j + 1 from
layer j over positions n + 1 .. n + j (j < M, M = the MTP layers), and past the last layer from one more entry
per depth on layer M - 1, fed its own previous output. Draft entries are trimmed before the next sync.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from ...runtime.mtp import MtpHead
from ..tree import DraftTree, chain_with_siblings
from . import DraftBudget, TargetState, top_candidates


CATCH_UP = 12  # positions synced at once beyond what one speculative step commits (depth 8 + 1, with slack)


class _Rows:
    """Outputs of one depth for consecutive positions start .. start + len(rows) - 1."""

    def __init__(self, start: int, rows: torch.Tensor):
        self.start, self.rows = start, rows

    def span(self, first: int, end: int) -> torch.Tensor:
        return self.rows[first - self.start:end - self.start]


class MtpDrafter:
    name = "mtp"
    needs_hidden = True

    def __init__(self, model, capacity: int):
        self.head = MtpHead(model)
        self.M = self.head.count
        self.caches = [self.head.new_cache(capacity) for _ in range(self.M)]
        self.end = list(range(self.M))  # last position with a real entry (layer k starts at k + 1)
        self.real = [0] * self.M  # real entries per layer cache
        self.last: list[_Rows | None] = [None] * self.M  # each layer's output at its `end` (real)
        self.logits: torch.Tensor | None = None  # layer 0's logits at the root (drafts depth 1)
        self.catch_up_s = 0.0  # last propose's time syncing more than one step's worth of positions

    def pending(self, context_len: int) -> int:
        """Positions the next proposal must first sync (after steps drafted without this drafter)."""
        return max(0, context_len - 1 - self.end[0])

    def rewind(self, n: int) -> None:
        """The request is over (the decode loop's finish): drop everything; a drafter serves one request."""
        self._restart(0)

    def _restart(self, position: int) -> None:
        """Empty caches; the first entries will be for positions after `position` (attention then covers a
        window of the context: drafts only, so correctness does not depend on it)."""
        for k, c in enumerate(self.caches):
            c.trim(c.length)
            self.end[k], self.real[k], self.last[k] = position + k, 0, None
        self.logits = None

    @torch.inference_mode()
    def propose(self, context: Sequence[int], state: TargetState, budget: DraftBudget) -> DraftTree:
        n = len(context) - 1  # the root's position
        for k, c in enumerate(self.caches):  # drop the previous step's draft entries
            c.trim(c.length - self.real[k])
        self._sync(context, state, n)
        if self.logits is None or self.end[0] != n:
            return DraftTree()
        cap = budget.node_cap
        cands, q_rows, sampled = [], [], False
        logits, prev = self.logits, self.last[0]  # prev: the depth in use's outputs at positions n ..
        for j in range(1, budget.depth + 1):
            tokens, q, sampled = top_candidates(logits, state, budget.width)
            cands.append(tokens)
            q_rows.append(q)
            if j == budget.depth or sum(map(len, cands)) >= cap:
                break
            drafts = torch.tensor([c[0] for c in cands])  # d_1 .. d_j at positions n + 1 .. n + j
            if j < self.M:  # layer j over positions n + 1 .. n + j, fed layer j - 1's outputs at n .. n + j - 1
                if self.end[j] != n or self.last[j] is None:
                    break  # context too short for layer j to have reached the root yet
                out_logits, out = self.head.forward(j, drafts, prev.span(n, n + j), torch.arange(n + 1, n + j + 1),
                                                    self.caches[j])
                prev = _Rows(n, torch.cat([self.last[j].rows, out]))
            else:  # past the last layer: one more entry on it, fed its own previous output
                out_logits, out = self.head.forward(self.M - 1, drafts[-1:], prev.span(n + j - 1, n + j),
                                                    torch.tensor([n + j]), self.caches[self.M - 1])
                prev = _Rows(n, torch.cat([prev.rows, out]))
            logits = out_logits[-1]
        return chain_with_siblings(cands, q_rows if sampled else None, sampled).prune(cap)

    def _sync(self, context: Sequence[int], state: TargetState, n: int) -> None:
        """Real entries up to position n on every layer, from the target's hidden rows and committed tokens.

        After steps without MTP drafting (the prompt, plain steps) this catches up on many positions at once:
        a one-off cost, reported as `catch_up_s` so the cost model does not take it for the per-step price."""
        self.catch_up_s = 0.0
        if self.end[0] >= n:
            return
        if state.hidden_start > self.end[0]:  # rows this layer stack never saw were dropped: start over there
            self._restart(state.hidden_start)
        start, span = time.perf_counter(), n - self.end[0]
        self._sync_layers(context, state, n)
        if span > CATCH_UP:
            self.catch_up_s = time.perf_counter() - start

    def _sync_layers(self, context: Sequence[int], state: TargetState, n: int) -> None:
        # the input of depth 0: the target's final-normed hidden state at positions end_0 .. n - 1
        rows = _Rows(self.end[0], self.head.trunk_hidden(state.take_hidden(self.end[0], n)))
        for k in range(self.M):
            lo = self.end[k] + 1
            if lo > n or rows.start > lo - 1:
                break  # not enough context for this layer yet
            toks = torch.tensor([int(t) for t in context[lo:n + 1]])
            logits, out = self.head.forward(k, toks, rows.span(lo - 1, n), torch.arange(lo, n + 1), self.caches[k])
            old = self.last[k]
            rows = _Rows(old.start, torch.cat([old.rows, out])) if old is not None else _Rows(lo, out)
            self.end[k], self.real[k], self.last[k] = n, self.caches[k].length, _Rows(n, out[-1:])
            if k == 0:
                self.logits = logits[-1]
