"""Fixed-size slot pools, allocated once per tier and charged to the ledger before allocation."""
from __future__ import annotations

import heapq
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..checkpoint.formats import keeps_stored_dtype
from ..checkpoint.layout import UnitLayout
from ..checkpoint.naming import UnitKey
from ..errors import BudgetError, out_of_memory_as_error
from ..planner.placement import ROW_KINDS, KindSize, TierPlan
from .hostmem import host_buffer, pinned_host_buffer
from .ledger import Ledger
from .weights import Weights


@dataclass(frozen=True)
class SlotState:
    """What a slot holds at one moment (TieredStore.slot_states)."""

    tier: str
    kind: str
    index: int
    key: UnitKey | None
    refs: int
    reading: bool  # a read or copy into it is in flight (not finished)


@dataclass(eq=False)
class Slot:
    tier: str
    kind: str
    index: int
    blob: torch.Tensor  # uint8, slot_bytes long
    offset: int = 0  # where the unit's bytes begin in blob (a direct read lands them page-shifted)
    key: UnitKey | None = None
    refs: int = 0  # acquired and not yet released: never evicted
    loading: Future | None = None  # a read or copy into this slot is in flight
    last_use: int = 0
    score: float = 0.0  # aged use count (LFU)
    prefetched: bool = False  # filled by a prefetch and not yet used
    stale: bool = False  # a prefetch its layer's routing did not use: the first victim of any read
    # typed views of the unit last viewed here, for which (key, offset), and the names of those that need a cast
    # to the compute dtype: valid while (key, offset) match, a unit's layout in its blob being fixed (building
    # them costs ~30 us of Python per acquire)
    views: tuple[tuple[UnitKey, int, int], dict[str, torch.Tensor], frozenset[str]] | None = None
    prepared_bytes: int = 0  # charged for the tensors `prepare` added to those views (Prepared)
    fills: int = 0  # units placed here so far: views (and kernel forms written over the bytes) are per fill

    def state(self) -> SlotState:
        fut = self.loading
        return SlotState(self.tier, self.kind, self.index, self.key, self.refs, fut is not None and not fut.done())

    def weights(self, layout: UnitLayout, dtype: torch.dtype, prepare: "Prepared | None" = None) -> Weights:
        """The typed views of `layout`'s unit in this slot, plain floating ones cast to `dtype` (and the tensors
        `prepare` derives from them, built with them)."""
        cached = self.views
        if cached is None or cached[0] != (layout.key, self.offset, self.fills):
            if prepare is None:
                cached = self._build_views(layout, dtype, None)
            else:
                with prepare.lock:  # forms written in place must be written once: the check again, under the lock
                    cached = self.views
                    if cached is None or cached[0] != (layout.key, self.offset, self.fills):
                        cached = self._build_views(layout, dtype, prepare)
        _, views, cast = cached
        # a copy: callers may rebind entries, never the slot's cached views
        return {k: (v.to(dtype) if k in cast else v) for k, v in views.items()} if cast else dict(views)

    def _build_views(self, layout: UnitLayout, dtype: torch.dtype, prepare: "Prepared | None"):
        """Views of this fill's unit (and its kernel forms), cached on the slot."""
        if prepare is not None:
            prepare.drop(self)
        self.views = None  # the old unit's views (and what was derived from them) go now
        views = layout.views(self.blob[self.offset:])
        cast = frozenset(k for k, v in views.items()
                         if v.is_floating_point() and v.dtype != dtype and not keeps_stored_dtype(k))
        if prepare is not None:
            views = prepare.add(self, views, dtype, self.blob[self.offset + layout.nbytes:])
        self.views = ((layout.key, self.offset, self.fills), views, cast)
        return self.views


@dataclass(eq=False)
class Prepared:
    """Tensors the runtime derives from a unit's views (runtime/kernels: weights in a CPU kernel's form), built
    once when a slot's views of the unit are and dropped with them. `hook`: plan(views, dtype) -> items with
    .tail / .nbytes; carver(tail) -> something with .fits(nbytes); build(views, items, dtype, carver or None) ->
    runtime.kernels.select.Built.

    On the tiers in `in_place_tiers` (the compute tier: its slots are never copied from) the forms' data goes
    over the stored data in place and the rest into the slot's tail, which the planner sized for it
    (planner/kernel_room.py): no new bytes. Elsewhere, or where the tail is short, the forms are new tensors
    charged to the slot's tier before they are built, like every byte the store holds; where the budget has no
    room they are not built (`declined`) and the runtime computes that unit by dequantizing."""

    hook: Any
    ledger: Ledger
    in_place_tiers: frozenset[str] = frozenset()
    lock: threading.Lock = field(default_factory=threading.Lock)
    built: int = 0  # units given kernel forms
    in_place: int = 0  # of which written over their stored data and carved from their slot's tail
    declined: int = 0  # units computed without their derived tensors for want of budget
    WHAT = "repacked weights"

    def counts(self) -> dict[str, int]:
        return {"built": self.built, "in_place": self.in_place, "declined": self.declined}

    def add(self, slot: Slot, views: dict[str, torch.Tensor], dtype: torch.dtype,
            tail: torch.Tensor) -> dict[str, torch.Tensor]:
        if slot.kind in ROW_KINDS:  # looked up by rows, never multiplied: no kernel form would be read
            return views
        planned = self.hook.plan(views, dtype)
        if not planned:
            return views
        carver = None
        if slot.tier in self.in_place_tiers:
            carver = self.hook.carver(tail)
            if not carver.fits(sum(p.tail for p in planned)):
                carver = None
        nbytes = 0 if carver is not None else sum(p.nbytes for p in planned)
        try:
            if nbytes:
                self.ledger.charge(slot.tier, nbytes, self.WHAT)
        except BudgetError:
            self.declined += 1
            return views
        try:
            built = self.hook.build(views, planned, dtype, carver)
        except BaseException:
            if nbytes:
                self.ledger.credit(slot.tier, nbytes, self.WHAT)
            raise
        unused = built.unused if carver is None else 0
        if unused:
            self.ledger.credit(slot.tier, unused, self.WHAT)
        slot.prepared_bytes = nbytes - unused
        if built.tensors:
            self.built += 1
            self.in_place += carver is not None
        kept = {k: v for k, v in views.items() if k not in built.replaced}  # overwritten: no longer the stored form
        return {**kept, **built.tensors}

    def drop(self, slot: Slot) -> None:
        if slot.prepared_bytes:
            self.ledger.credit(slot.tier, slot.prepared_bytes, self.WHAT)
            slot.prepared_bytes = 0


@dataclass(eq=False)
class Tier:
    name: str
    device: torch.device
    pinned_kinds: set[str]
    pools: dict[str, list[Slot]] = field(default_factory=dict)
    resident: dict[UnitKey, Slot] = field(default_factory=dict)
    # Per kind, so a miss does not scan every slot (thousands on a large model): occupied slots by their unit's
    # layer, and free slots. The free lists are checked when taken (entries may be stale), never trusted.
    by_layer: dict[str, dict[int, dict[int, Slot]]] = field(default_factory=dict)
    free: dict[str, list[Slot]] = field(default_factory=dict)
    # slots handed to a prefetch and marked stale, per kind: registers pruned when read (their flags decide)
    prefetched: dict[str, dict[int, Slot]] = field(default_factory=dict)
    stale: dict[str, dict[int, Slot]] = field(default_factory=dict)
    # per kind in recency_kinds (those whose eviction walks LRU order: the store's lru-floor), (last_use, index) of
    # every stamp (Tier.stamp): a heap whose entries go stale when their slot is stamped again or emptied, dropped
    # when met, so finding the least recent unit that may go costs a few pops
    recency_kinds: set[str] = field(default_factory=set)
    recency: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    unpin: list = field(default_factory=list)  # page-locked pools' unregister calls (free_all runs them)

    def provision(self, plan: TierPlan, sizes: dict[str, KindSize], ledger: Ledger, pin_memory: bool) -> None:
        """Charge the plan's staging, KV cache and prompt cache bytes, and allocate its slots (charged first, each
        pool)."""
        if plan.staging_bytes:
            ledger.charge(self.name, plan.staging_bytes, "staging")
        if plan.kv_bytes:
            ledger.charge(self.name, plan.kv_bytes, "kv cache")
        if plan.prompt_cache_bytes:
            ledger.charge(self.name, plan.prompt_cache_bytes, "prompt cache")
        for kind, n in plan.slots.items():
            self.allocate(kind, n, sizes[kind].slot_bytes, ledger, pin_memory=pin_memory)

    def unprovision(self, plan: TierPlan, ledger: Ledger) -> None:
        """Free every slot and credit what `provision` (and the row cache, rows.row_caches) charged, as far as
        it was charged (a store whose construction failed midway closes too)."""
        self.free_all(ledger)
        items = ledger.accounts[self.name].items
        for what, n in (("staging", plan.staging_bytes), ("kv cache", plan.kv_bytes),
                        ("row cache", plan.row_cache_bytes), ("prompt cache", plan.prompt_cache_bytes)):
            if n and items.get(what):
                ledger.credit(self.name, n, what)

    def allocate(self, kind: str, count: int, slot_bytes: int, ledger: Ledger, pin_memory: bool) -> None:
        """`count` slots of `slot_bytes`, charged before they are allocated: one allocation per pool, sliced into
        slots (slot_bytes is a multiple of 64, so typed views stay aligned). CPU memory: a huge-page region
        (store.hostmem), page-locked in place with `pin_memory` (CUDA host tier); device memory: torch's."""
        pool = self.pools.setdefault(kind, [])
        nbytes = count * slot_bytes
        blobs = self._charged(ledger, kind, nbytes, f"{count} {kind} slots of {slot_bytes} bytes",
                              lambda: self._region(nbytes, pin_memory).split(slot_bytes)) if count else ()
        pool.extend([Slot(self.name, kind, index, blob) for index, blob in enumerate(blobs, start=len(pool))])
        self.free[kind] = [s for s in reversed(pool) if s.key is None]  # taken from the end: lowest index first

    def _region(self, nbytes: int, pin_memory: bool) -> torch.Tensor:
        """One allocation per pool. On a GPU too: the CUDA caching allocator serves 1-10 MiB requests from 20 MiB
        segments, so slot-sized allocations would reserve more VRAM than the ledger charged."""
        if self.device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if not pin_memory:
            return host_buffer(nbytes)
        buf, unpin = pinned_host_buffer(nbytes)
        if unpin is not None:
            self.unpin.append(unpin)
        return buf

    def _charged(self, ledger: Ledger, kind: str, nbytes: int, what: str, allocate):
        ledger.charge(self.name, nbytes, f"{kind} slots")
        try:
            with out_of_memory_as_error(f"{self.name} tier ({self.device}): {what}"):
                return allocate()
        except BaseException:  # the allocator refused (memory used outside the budget): the charge is void
            ledger.credit(self.name, nbytes, f"{kind} slots")
            raise

    def place(self, slot: Slot, key: UnitKey) -> None:
        """`slot` now holds `key` (an empty slot, or one whose unit was `unplace`d)."""
        slot.key = key
        slot.fills += 1  # new bytes are coming: the last fill's views (and forms in place) no longer hold
        self.resident[key] = slot
        self.by_layer.setdefault(slot.kind, {}).setdefault(key.layer, {})[slot.index] = slot
        self.stamp(slot, slot.last_use)  # in the recency heap at its current age until it is used

    def unplace(self, slot: Slot) -> None:
        """Forget the unit `slot` holds in the maps (the caller resets or replaces `slot.key`)."""
        if slot.key is None:
            return
        if self.resident.get(slot.key) is slot:
            del self.resident[slot.key]
        layers = self.by_layer.get(slot.kind, {})
        group = layers.get(slot.key.layer)
        if group is not None:
            group.pop(slot.index, None)
            if not group:
                del layers[slot.key.layer]

    def stamp(self, slot: Slot, tick: int) -> None:
        """Record a use of `slot` at store tick `tick` (every change of `last_use` goes through here)."""
        slot.last_use = tick
        if slot.kind not in self.recency_kinds:
            return
        heap = self.recency.setdefault(slot.kind, [])
        heapq.heappush(heap, (tick, slot.index))
        if len(heap) > 4 * len(self.pools.get(slot.kind, ())) + 64:  # mostly stale entries: rebuild
            heap[:] = [(s.last_use, s.index) for s in self.pools[slot.kind] if s.key is not None]
            heapq.heapify(heap)

    def least_recent(self, kind: str, may_go: Callable[[Slot], bool]) -> Slot | None:
        """The least recently used occupied slot of `kind` (one of recency_kinds) that `may_go` accepts (ties: the
        lower index)."""
        heap, pool, passed, found = self.recency.get(kind, []), self.pools.get(kind, []), [], None
        while heap and found is None:
            last, index = heapq.heappop(heap)
            slot = pool[index]
            if slot.key is None or slot.last_use != last:
                continue  # stale: the slot was stamped again (a newer entry exists) or emptied
            if may_go(slot):
                found = slot
            passed.append((last, index))
        for entry in passed:
            heapq.heappush(heap, entry)
        return found

    def take_free(self, kind: str) -> Slot | None:
        stack = self.free.get(kind, [])
        while stack:
            slot = stack.pop()
            if slot.key is None:
                return slot
        return None

    def flagged(self, register: dict[str, dict[int, Slot]], kind: str, flag: str) -> list[Slot]:
        """The slots of `register[kind]` whose `flag` is still set, dropping the others from the register."""
        slots = register.get(kind, {})
        for index in [i for i, s in slots.items() if not getattr(s, flag)]:
            del slots[index]
        return list(slots.values())

    def free_all(self, ledger: Ledger) -> None:
        while self.unpin:  # page-locked pools back to pageable before their last views go
            self.unpin.pop()()
        for kind, pool in self.pools.items():
            for slot in pool:
                ledger.credit(self.name, slot.blob.numel(), f"{kind} slots")
                if slot.prepared_bytes:
                    ledger.credit(self.name, slot.prepared_bytes, Prepared.WHAT)
                    slot.prepared_bytes, slot.views = 0, None
        for index in (self.pools, self.resident, self.by_layer, self.free, self.prefetched, self.stale, self.recency):
            index.clear()
