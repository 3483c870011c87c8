"""Which slot a unit gets: a free one, else one whose unit goes per policy (policy.py's pure choosers over the
tier's indexes); and the bookkeeping of slots whose reads nobody waits for (settle), emptied (drop) or used
(touch). The store's use counter (`tick`) lives here: it is the recency clock eviction compares."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Iterable

from ..checkpoint.naming import UnitKey
from ..config import PREFETCH_SLOTS
from .policy import Usage, aged_count, choose_victim, layer_to_evict, may_take, resolved
from .stats import StoreStats
from .tier import Slot, Tier


def failed(fut: Future | None) -> bool:
    return fut is not None and fut.done() and (fut.cancelled() or fut.exception() is not None)


class Evictor:
    def __init__(self, tiers: Iterable[Tier], lock: threading.RLock, stats: StoreStats, policy: str,
                 expert_layers: int, expert_floor: int, prefetch_slots: int = PREFETCH_SLOTS):
        self.tiers = {t.name: t for t in tiers}
        self.lock, self.stats, self.policy = lock, stats, policy
        # layer-lru gives each MoE layer an equal share of a tier's expert slots; lru-floor leaves each layer the
        # experts a token routes to
        self.expert_layers, self.expert_floor = expert_layers, expert_floor
        self.prefetch_slots = prefetch_slots  # per kind: slots prefetched, unused units may hold (see reserve)
        self.tick = 0  # the use counter: one per acquired unit (the store advances it)

    def reserve(self, tier: Tier, key: UnitKey, used_before: int | None = None,
                prefetching: bool = False) -> Slot | None:
        """A slot of `tier` for `key` (refs=1, marked loading), evicting per policy; None if all are busy.
        A stale prefetch (a guess its layer's routing did not use) is the first victim of any read. A prefetch
        (`prefetching`) evicts a cached unit only while fewer than `prefetch_slots` slots of the kind hold
        prefetched, unused units, and then never one used since `used_before` (a tick); past that quota it
        recycles stale guesses only. So wrong guesses never push out more of the cache than the quota, and a
        right guess (kept by the cache) frees its quota place at the eviction a demand miss would have made. A
        prefetch never evicts a unit prefetched and not yet judged (the layer after next must not throw away the
        next layer's unit)."""
        with self.lock:
            slot = tier.take_free(key.kind) or self._stale_victim(tier, key.kind)
            if slot is None:
                if prefetching and len(tier.flagged(tier.prefetched, key.kind, "prefetched")) >= self.prefetch_slots:
                    return None
                victim = self._victim(tier, key, used_before, prefetching)
                slot = tier.take_free(key.kind) or victim  # settling may have emptied a slot
                if slot is None:
                    return None
            if slot.key is not None:
                if slot.prefetched:
                    self.stats.prefetch_wasted += 1
                tier.unplace(slot)
            tier.place(slot, key)
            slot.refs, slot.score, slot.prefetched, slot.stale = 1, 0.0, False, False
            tier.stamp(slot, self.tick)  # not the evicted unit's age: landed, it is stamped by its acquire
            slot.loading = Future()  # placeholder until the real future is attached
            return slot

    def _stale_victim(self, tier: Tier, kind: str) -> Slot | None:
        """The least recently used stale prefetch nobody holds (call with the lock held)."""
        best = None
        for s in tier.flagged(tier.stale, kind, "stale"):
            if s.loading is not None:
                self.settle(tier, s)
            if s.stale and s.key is not None and not s.refs and s.loading is None:
                if best is None or s.last_use < best.last_use:
                    best = s
        return best

    def _layer_share(self, tier: Tier, kind: str) -> int:
        """Slots of `kind` per MoE layer in `tier` (layer-lru's share)."""
        return max(1, len(tier.pools.get(kind, [])) // self.expert_layers)

    def expert_policy(self, tier: Tier) -> str:
        """The eviction rule `tier`'s expert cache runs under (policy.resolved: lru-floor needs room)."""
        return resolved(self.policy, self._layer_share(tier, "expert"), self.expert_floor)

    def _victim(self, tier: Tier, key: UnitKey, used_before: int | None, prefetching: bool) -> Slot | None:
        """The unit to evict per policy, among evictable ones (call with the lock held). layer-lru looks at the
        incoming unit's layer and at the layer holding the most slots, not at every slot (O(slots per layer) per
        miss); lru-floor walks the tier's recency heap from its least recent end; the other policies, and these
        two when those find nothing, scan the pool."""
        pool = tier.pools.get(key.kind, [])
        share, floor = self._layer_share(tier, key.kind), self.expert_floor
        # the policy governs expert caches; the few streaming slots of other kinds are plain LRU
        policy = self.expert_policy(tier) if key.kind == "expert" else "lru"

        def usable(s: Slot) -> bool:
            if s.loading is not None:
                self.settle(tier, s)
            return not (s.key is None or s.refs or s.loading is not None or s.stale
                        or (prefetching and s.prefetched) or (used_before is not None and s.last_use >= used_before))

        def evictable(slots: Iterable[Slot]) -> list[Usage]:
            return [Usage(s.index, s.key.layer, s.last_use, s.score) for s in slots if usable(s)]

        groups = tier.by_layer.get(key.kind, {})
        occupied = {layer: len(g) for layer, g in groups.items()}
        if policy == "layer-lru":
            own = evictable(list(groups.get(key.layer, {}).values()))
            layer = layer_to_evict(len(own), share, occupied, key.layer)
            candidates = own if layer == key.layer else evictable(list(groups.get(layer, {}).values()))
            if candidates:
                return pool[choose_victim("lru", candidates, key.layer, share, self.tick)]
        if policy == "lru-floor":  # the least recent unit it may take, from the tier's recency heap
            oldest = tier.least_recent(key.kind, lambda s: usable(s) and may_take(s.key.layer, key.layer, floor,
                                                                                  occupied))
            if oldest is not None:
                return oldest
        candidates = evictable(pool)
        if not candidates:
            return None
        return pool[choose_victim(policy, candidates, key.layer, share, self.tick, floor, occupied)]

    def settle(self, tier: Tier, slot: Slot) -> None:
        """A read nobody waits for any more (its request failed or stopped early) has finished: a landed unit
        becomes an ordinary resident (evictable) one, a failed or cancelled one frees its slot. Call with the
        lock held."""
        fut = slot.loading
        if fut is None or slot.refs or not fut.done():
            return
        if failed(fut):
            self.drop(tier, slot)
        else:
            slot.loading = None

    def drop(self, tier: Tier, slot: Slot) -> None:
        """Empty `slot`: its unit is forgotten, the slot is free."""
        with self.lock:
            if slot.key is not None:
                tier.unplace(slot)
                tier.free.setdefault(slot.kind, []).append(slot)
            slot.key, slot.refs, slot.loading, slot.prefetched, slot.stale = None, 0, None, False, False

    def touch(self, slot: Slot, tick: int) -> None:
        """A use of `slot`'s unit at `tick`: recency and the aged use count (LFU)."""
        slot.score = aged_count(slot.score, slot.last_use, tick) + 1.0
        self.tiers[slot.tier].stamp(slot, tick)
