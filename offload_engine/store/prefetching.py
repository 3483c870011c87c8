"""Reads ahead (prefetches): started into free or evictable compute-tier slots within the quota (Evictor.reserve),
cancelled or marked stale once routing proves them wrong, and claimed by the request that uses one (it then
counts as a read made ahead)."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from functools import partial
from typing import Sequence

from ..checkpoint.naming import UnitKey
from .eviction import Evictor
from .fill import Filler
from .readers import PREFETCH, ReaderPool
from .stats import StoreStats
from .tier import Slot, Tier


class Prefetches:
    def __init__(self, compute: Tier, evictor: Evictor, filler: Filler, pool: ReaderPool, lock: threading.RLock,
                 stats: StoreStats):
        self.compute, self.evictor, self.filler, self.pool, self.lock, self.stats = (compute, evictor, filler, pool,
                                                                                     lock, stats)

    def claim(self, slot: Slot, key: UnitKey) -> None:
        """A request uses the unit a prefetch read (or is reading) into `slot`: it joins the cache, and counts as
        a read made ahead. Call with the lock held."""
        if slot.prefetched:
            slot.prefetched = slot.stale = False
            self.stats.prefetch_used += 1
            if key.kind == "expert":
                self.stats.expert_reads["ahead"] += 1

    def in_flight(self, kind: str | None = None) -> list[Future]:
        with self.lock:
            kinds = [kind] if kind is not None else list(self.compute.prefetched)
            return [s.loading for k in kinds for s in self.compute.flagged(self.compute.prefetched, k, "prefetched")
                    if s.loading is not None]

    def start(self, keys: Sequence[UnitKey], used_before: int | None = None, limit: int | None = None) -> int:
        """Best effort, asynchronous: start reads of units not yet resident into free or evictable slots (see
        Evictor.reserve for which), in the order given and at most `limit` of them. Never evicts a unit in use or in
        flight, and never holds more than half of a kind's slots, so demand reads always find room; returns how
        many reads it started."""
        started, full = 0, set()  # kinds with no slot to spare in this call
        with self.lock:
            for key in keys:
                if limit is not None and started >= limit:
                    break
                pool = self.compute.pools.get(key.kind)
                if key in self.compute.resident or not pool or key.kind in full:
                    continue
                if len(self.in_flight(key.kind)) >= max(1, len(pool) // 2):
                    continue
                slot = self.evictor.reserve(self.compute, key, used_before, prefetching=True)
                if slot is None:
                    full.add(key.kind)  # this kind's slots are all busy or warm; another kind's may not be
                    continue
                # as recent as the latest use: otherwise it keeps its victim's age and is the next victim itself
                slot.refs, slot.prefetched = 0, True
                self.compute.stamp(slot, self.evictor.tick)
                self.compute.prefetched.setdefault(key.kind, {})[slot.index] = slot
                slot.loading = self.pool.submit(PREFETCH, partial(self.filler.prefetch_fill, key, slot), str(key))
                self.stats.prefetch_issued += 1
                started += 1
        return started

    def cancel(self, keys: Sequence[UnitKey]) -> int:
        """The routing proved these prefetches wrong: drop those not started that nobody waits for, and mark the
        others stale (the first victims of the next reads)."""
        cancelled = 0
        with self.lock:
            for key in keys:
                slot = self.compute.resident.get(key)
                if slot is None or not slot.prefetched:
                    continue
                if slot.refs == 0 and slot.loading is not None and slot.loading.cancel():
                    self.evictor.drop(self.compute, slot)
                    self.stats.prefetch_cancelled += 1
                    cancelled += 1
                else:
                    slot.stale = True
                    self.compute.stale.setdefault(key.kind, {})[slot.index] = slot
        return cancelled
