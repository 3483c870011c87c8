"""The rank-to-rank forward: rank 0 drives, the other ranks serve its commands around the ring.

Stages run in ring order starting at rank 1: rank 1 holds the first layers and the embedding, rank r the next
ones, and rank 0 the last layers, the head and the MTP layers, so the rank that samples (and prints) holds
everything sampling and drafting need. One forward (a decode step, a prompt chunk, or a whole draft tree for
verification) is one trip around the ring: rank 0 sends the token ids (and a tree's positions and mask) to
rank 1, each rank runs its layers over the hidden state [T, H] and sends it on, rank 0 runs its own and the
head. Every rank keeps its own KV cache (and recurrent DeltaNet state) for its layers: rank 0's cache object
(RingCache) mirrors each new cache, trim and keep to the other ranks, so they stay in step.
"""
from __future__ import annotations

import itertools
import json
import weakref
from typing import Any

import torch

from ..errors import OffloadEngineError
from ..runtime.layers import causal_mask
from ..runtime.model import CausalLM
from .group import Link, RankFailedError, decode_text, encode_text

# ops: the first slot of a message's header
FORWARD, NEW, FREE, TRIM, KEEP, STATS, CLOSE, ERROR, CHECK = range(1, 10)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # hidden states' dtype, by its code in the header
HAS_POSITIONS, HAS_MASK = 1, 2  # FORWARD's flags


class Ring:
    """Rank 0's end of the ring: commands out to rank 1, replies in from the last rank."""

    def __init__(self, link: Link, hidden_size: int, recurrent: bool = False):
        """recurrent: some layer keeps a recurrent state (DeltaNet): a rewind is first checked on every rank."""
        self.link, self.hidden_size, self.recurrent = link, hidden_size, recurrent
        self.failed: RankFailedError | None = None
        self._ids = itertools.count()
        self._freed: list[int] = []  # caches dropped since the last command (a finalizer appends here)
        self.closed = False

    def command(self, op: int, *numbers: int, tensors: tuple[torch.Tensor, ...] = ()) -> None:
        self.check()
        while self._freed:
            self._send(FREE, self._freed.pop())
        self._send(op, *numbers, tensors=tensors)

    def _send(self, op: int, *numbers: int, tensors: tuple[torch.Tensor, ...] = ()) -> None:
        try:
            self.link.send(op, *numbers, tensors=tensors)
        except RankFailedError as e:
            self.failed = e
            raise

    def check(self) -> None:
        if self.failed is not None:
            raise RankFailedError(self.failed.rank, f"the pipeline broke earlier ({self.failed}); open the engine "
                                                    f"again (every rank)")
        if self.closed:
            raise OffloadEngineError("the pipeline is closed")

    def expect(self, op: int) -> list[int]:
        """The next reply's header, which must be `op`; an ERROR from a rank raises RankFailedError naming it."""
        try:
            header = self.link.recv_header()
            if header[0] == ERROR:
                raise RankFailedError(header[1], decode_text(self.link.recv((header[2],), torch.uint8)))
        except RankFailedError as e:
            self.failed = e
            raise
        if header[0] != op:
            self.failed = RankFailedError(self.link.topology.previous, f"sent op {header[0]}, expected {op}")
            raise self.failed
        return header

    def new_cache(self, capacity: int) -> int:
        cache_id = next(self._ids)
        self.command(NEW, cache_id, capacity)
        return cache_id

    def can_rewind(self, cache_id: int, position: int) -> bool:
        """Whether every other rank's cache can be brought back to `position` (their recurrent layers' windows
        differ from rank 0's when rank 0's layers have none): asked before a trim or keep changes any rank."""
        self.command(CHECK, cache_id, position, 1)
        return bool(self.expect(CHECK)[3])

    def free(self, cache_id: int) -> None:
        self._freed.append(cache_id)

    def forward(self, cache_id: int, tokens: torch.Tensor, positions: torch.Tensor | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Send a forward's input to rank 1; the hidden state [T, H] the last rank before rank 0 returns."""
        T = tokens.shape[0]
        flags = (HAS_POSITIONS if positions is not None else 0) | (HAS_MASK if mask is not None else 0)
        extra = tuple(t for t in (positions, None if mask is None else mask.to(torch.uint8)) if t is not None)
        self.command(FORWARD, cache_id, T, flags, 0 if mask is None else mask.shape[1], 0,
                     tensors=(tokens.to(torch.int64), *extra))
        header = self.expect(FORWARD)
        try:
            return self.link.recv((T, self.hidden_size), DTYPES[header[5]])
        except RankFailedError as e:
            self.failed = e
            raise

    def stats(self) -> list[dict[str, Any]]:
        """Every other rank's figures (stage, memory), gathered around the ring."""
        self.command(STATS, 2, tensors=(encode_text("[]"),))
        header = self.expect(STATS)
        return json.loads(decode_text(self.link.recv((header[1],), torch.uint8)))

    def close(self) -> None:
        """Tell every rank to stop serving, and wait for that to come back around (unless the ring broke)."""
        if self.closed or self.failed is not None:
            self.closed = True
            return
        try:
            self.command(CLOSE)
            self.expect(CLOSE)
        except RankFailedError:
            pass  # a rank failed since the last request: closing is all that was left to do (`failed` says it)
        finally:
            self.closed = True


class RingCache:
    """Rank 0's KV cache of one sequence: its own layers' (`local`), with every change mirrored around the ring."""

    def __init__(self, ring: Ring, local: Any):
        self.ring, self.local = ring, local
        self.id = ring.new_cache(local.capacity)
        weakref.finalize(self, ring.free, self.id)

    @property
    def length(self) -> int:
        return self.local.length

    @property
    def capacity(self) -> int:
        return self.local.capacity

    @property
    def state_nbytes(self) -> int:
        return self.local.state_nbytes

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    def advance(self, n: int) -> None:
        self.local.advance(n)  # each rank advances its own cache as its layers finish

    def _check(self, position: int) -> None:
        if self.ring.recurrent and self.ring.failed is None and not self.ring.can_rewind(self.id, position):
            raise ValueError(f"cannot rewind the cache to position {position}: a rank's recurrent state is kept "
                             f"only from a later position (after a chunked forward)")

    def trim(self, n: int) -> None:
        if n:
            self._check(self.local.length - n)
        self.local.trim(n)
        if n and self.ring.failed is None:
            self.ring.command(TRIM, self.id, n)

    def keep(self, positions: list[int]) -> None:
        if positions:
            self._check(positions[0] + len(positions))
        self.local.keep(positions)
        if self.ring.failed is None:
            self.ring.command(KEEP, self.id, len(positions), tensors=(torch.tensor(positions, dtype=torch.int64),))


class PipelineLM:
    """Rank 0's model: the same forward as CausalLM (chunked prefill included), its layers and head local, the
    layers before them on the other ranks. Everything else (ops, source, MTP layers' needs) is the local
    CausalLM's."""

    forward = CausalLM.forward  # chunking and out-of-memory handling, over this class's forward_once
    _chunked = CausalLM._chunked

    def __init__(self, local: CausalLM, ring: Ring):
        self.local, self.ring = local, ring

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def new_cache(self, max_tokens: int) -> RingCache:
        return RingCache(self.ring, self.local.new_cache(max_tokens))

    def forward_once(self, tokens: torch.Tensor, cache: RingCache, positions: torch.Tensor | None,
                     mask: torch.Tensor | None, last_only: bool, return_hidden: bool):
        local, model = cache.local, self.local
        T = tokens.shape[0]
        hidden = self.ring.forward(cache.id, tokens, positions, mask)
        try:  # the other ranks advanced their caches: a failure here takes those positions back
            x = hidden.to(model.device, model.dtype)
            if positions is None:
                positions = torch.arange(local.length, local.length + T, device=model.device)
            if mask is None:
                mask = causal_mask(positions, local.length + T)
            x = model.run_layers(x, positions, local, mask)
            if last_only:
                x = x[-1:]
            logits = model.head(x)
        except BaseException:
            if self.ring.failed is None:
                self.ring.command(TRIM, cache.id, T)
            raise
        if model.prefetcher is not None:
            model.prefetcher.forward_finished()
        local.advance(T)
        return (logits, x) if return_hidden else logits
