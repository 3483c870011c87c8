"""The prompt cache: the KV cache (and recurrent state) of recent sequences kept within a byte limit (`serve
--cache-ram`), so that a prompt starting with one of them prefills only the rest. The match is exact, on token ids.

Two levels. The live cache is the last sequence's own (the engine's KV cache, charged to the budget as the kv
cache): a prompt that shares a prefix with it reuses it in place, with no copy. Saved entries are snapshots, copies
truncated to their sequence's length (KVCache.copy_prefix), in host memory: the live cache is saved whole when a
request diverges from it, and a request whose longest match is a saved entry gets a copy of the matched positions
loaded into the live cache's buffers (copy on reuse), so no request ever writes into an entry. Entries are evicted
least recently used first, by their bytes as measured from their tensors, to stay within the limit; limit 0 keeps
the live cache only (the engine's behaviour before the prompt cache).

Recurrent layers (hybrid models) can rewind their state only a few positions, so an entry serves the prefixes it
can rewind to. Where a prompt shares a longer prefix with a cached sequence than any cache can give (a system
prompt shared with an earlier request), that prefix is forwarded on its own first and saved: every later request
sharing it reuses it (such a system prompt is prefilled twice, then not again).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .prefix_cache import common_prefix

SOURCES = ("last", "saved")  # where reused positions came from: the live cache, or a saved entry


@dataclass(eq=False)  # entries are told apart by identity
class Entry:
    ids: list[int]  # the token ids of its positions
    cache: Any  # a KVCache of capacity len(ids), on the host
    nbytes: int  # measured from its tensors: entries as stored, recurrent states and their rewind logs


@dataclass
class Lease:
    """A cache for one request's prompt: it holds `reused` positions of it from before the request and `start`
    once take() returns (more than `reused` after a hybrid model's shared prefix was forwarded and saved, which
    took `prefill_s`); the caller forwards prompt[start:]."""

    cache: Any
    reused: int
    start: int
    source: str | None  # one of SOURCES, None when nothing was reused
    prefill_s: float = 0.0


class PromptCache:
    def __init__(self, model: Any, limit: int = 0):
        self.model = model  # new_cache(), forward(), max_context
        self.limit = limit  # bytes the saved entries may hold; 0: the live cache only
        self.live: Any = None
        self.live_ids: list[int] = []
        self.entries: list[Entry] = []  # least recently used first
        self.nbytes = 0
        self.hits = {s: 0 for s in SOURCES}
        self.tokens = {s: 0 for s in SOURCES}  # prompt tokens reused from each
        self.misses = self.evictions = 0

    def take(self, prompt: Sequence[int], needed: int) -> Lease:
        """A cache for `prompt` (the request then needs `needed` positions). At least the prompt's last token is
        always left to forward: its logits give the first new token."""
        most = len(prompt) - 1
        cache, ids = self.live, self.live_ids
        self.live, self.live_ids = None, []  # taken: a request that fails leaves nothing behind
        if cache is not None and needed > cache.capacity:
            self._save(cache, ids)
            cache = None
        keep = shared = min(common_prefix(ids, prompt), most) if cache is not None else 0
        if keep and not _can_rewind(cache, keep):
            keep = 0
        best, found = None, 0
        for entry in self.entries:
            n = min(common_prefix(entry.ids, prompt), most)
            shared = max(shared, n)
            if n > found and entry.cache.can_rewind(n):
                best, found = entry, n
        lease = None
        if keep and keep >= found:
            if keep < cache.length:
                self._save(cache, ids)  # the sequence diverges here: kept whole for a later request
            try:
                cache.trim(cache.length - keep)
                lease = Lease(cache, keep, keep, "last")
            except ValueError:  # a recurrent state a pipeline rank cannot rewind to `keep`
                cache = None
        else:
            if best is not None:
                self._touch(best)  # first: saving the live cache then evicts other entries before this one
            if cache is not None:
                self._save(cache, ids)
            if best is not None:
                if cache is None or not hasattr(cache, "load"):
                    cache = self._new()
                cache.load(best.cache, found)  # copies: the entry stays as it was
                lease = Lease(cache, found, found, "saved")
        if lease is None:
            if cache is None or not hasattr(cache, "load"):
                cache = self._new()
            cache.trim(cache.length)  # a fresh sequence in the buffers already allocated
            lease = Lease(cache, 0, 0, None)
        if lease.source is None:
            self.misses += 1
        else:
            self.hits[lease.source] += 1
            self.tokens[lease.source] += lease.reused
        if shared > lease.start and self.limit > 0:
            self._forward_shared(lease, prompt[:shared])
        return lease

    def give_back(self, cache: Any, sequence: Sequence[int]) -> None:
        """Keep `cache` as the live one; `sequence` is the prompt then the generated ids, of which the cache holds
        the first cache.length (the last generated id is never forwarded)."""
        if cache.length <= len(sequence):
            self.live, self.live_ids = cache, list(sequence[:cache.length])

    def set_aside(self, save: bool = True) -> None:
        """Drop the live cache (a request that does not reuse it takes the memory), saved first with `save`."""
        if save and self.live is not None:
            self._save(self.live, self.live_ids)
        self.live, self.live_ids = None, []

    def clear(self) -> None:
        self.live, self.live_ids = None, []
        self.entries, self.nbytes = [], 0

    def snapshot(self) -> dict[str, Any]:
        """What /metrics shows: the saved entries and their bytes, hits and reused tokens by source, misses."""
        return {"limit_bytes": self.limit, "entries": len(self.entries), "bytes": self.nbytes,
                "hits": dict(self.hits), "tokens": dict(self.tokens), "misses": self.misses,
                "evictions": self.evictions}

    # ---- internals -------------------------------------------------------------------------------------------
    def _new(self) -> Any:
        return self.model.new_cache(self.model.max_context)  # the engine's whole context (its bytes are budgeted)

    def _touch(self, entry: Entry) -> None:
        self.entries.remove(entry)
        self.entries.append(entry)

    def _forward_shared(self, lease: Lease, shared: Sequence[int]) -> None:
        """Forward the prompt's shared prefix on its own and save the cache there (hybrid models: no cache could
        rewind to it), so the next request sharing it starts from it."""
        start = time.perf_counter()
        tokens = torch.tensor(list(shared[lease.start:]), dtype=torch.long, device=getattr(self.model, "device", None))
        self.model.forward(tokens, lease.cache, last_only=True)
        lease.prefill_s += time.perf_counter() - start
        lease.start = len(shared)
        self._save(lease.cache, list(shared))

    def _save(self, cache: Any, ids: Sequence[int]) -> None:
        """Save a copy of `cache` (holding `ids`) as an entry, unless an entry already serves all of it; entries it
        serves all of are dropped. Least recently used entries go until the bytes fit the limit."""
        n = cache.length
        if self.limit <= 0 or n == 0 or not hasattr(cache, "copy_prefix"):  # a pipeline rank's cache: no copies
            return
        ids = list(ids[:n])
        for entry in self.entries:
            if len(entry.ids) >= n and entry.ids[:n] == ids and entry.cache.can_rewind(n):
                self._touch(entry)
                return
        estimate = cache.prefix_nbytes(n) + cache.state_nbytes
        if estimate > self.limit:
            return
        self._evict(self.limit - estimate)
        copy = cache.copy_prefix(n)
        entry = Entry(ids, copy, copy.nbytes + copy.state_nbytes)
        served = [e for e in self.entries if len(e.ids) <= n and ids[:len(e.ids)] == e.ids
                  and copy.can_rewind(len(e.ids))]
        self.entries = [e for e in self.entries if all(e is not s for s in served)] + [entry]
        self.nbytes += entry.nbytes - sum(e.nbytes for e in served)
        self._evict(self.limit)

    def _evict(self, room: int) -> None:
        while self.entries and self.nbytes > room:
            gone = self.entries.pop(0)
            self.nbytes -= gone.nbytes
            self.evictions += 1


def _can_rewind(cache: Any, position: int) -> bool:
    """Whether the cache can be trimmed back to `position` (a pipeline rank's cache tells only by trying)."""
    check = getattr(cache, "can_rewind", None)
    return True if check is None else bool(check(position))
