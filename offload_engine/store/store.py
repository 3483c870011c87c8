"""TieredStore: units move disk -> host -> device on demand, within hard per-tier budgets.

acquire(keys) yields resident units first and the others as their reads land, so compute on resident experts
overlaps the reads of missing ones; acquired units are never evicted until released. Reads run on a reader
pool (demand before prefetch); a read error reaches the caller as an IOFault naming shard and offset, and the
store stays usable (the failed slot is emptied, nothing half-read is ever served). A read that makes no progress
for `stall_timeout` seconds surfaces as an IOStallError naming the shard and offset it is stuck at.

A request that fails leaves reads behind (queued or in flight): they are cancelled where they have not started,
and the slots of the others become evictable (or are emptied) once they finish, so failed requests never shrink
the cache. A request that finds a unit being read by someone else (a prefetch, an aborted request) and sees that
read fail reads the unit again itself: it only ever reports faults of its own reads.

This module is the facade: acquire / release / prefetch and the bookkeeping of requests. Its rooms: unit_io.py
(the bytes: disk and copy I/O, injectable), fill.py (what a reader does to fill a slot), eviction.py (which slot
a unit gets), rows.py (row kinds and their cache), stats.py (the counters).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..checkpoint.model import ModelCheckpoint
from ..checkpoint.naming import UnitKey
from ..config import PREFETCH_SLOTS
from ..constants import BOUNCE_BYTES, READER_THREADS, STALL_TIMEOUT_S
from ..errors import BudgetError, EngineClosedError
from ..interrupts import finish_despite_interrupts
from ..planner.placement import Placement
from .eviction import Evictor, failed
from .fill import Filler
from .gds import GdsReader
from .ledger import Ledger
from .prefetching import Prefetches
from .readers import DEMAND, ReaderPool
from .rows import RowCache, RowReader, row_caches, row_tensor
from .stats import StoreStats
from .tier import Prepared, Slot, SlotState, Tier
from .unit_io import CopyFn, ReadFn, UnitIO
from .weights import Weights

__all__ = ["CopyFn", "ReadFn", "StoreStats", "TieredStore", "UnitIO"]


class TieredStore:
    def __init__(self, checkpoint: ModelCheckpoint, placement: Placement, ledger: Ledger, device: torch.device,
                 dtype: torch.dtype, *, policy: str = "lru-floor", direct_io: bool = False,
                 threads: int = READER_THREADS, bounce_bytes: int = BOUNCE_BYTES, gds: bool = True,
                 stall_timeout: float = STALL_TIMEOUT_S, read_fn: ReadFn | None = None, copy_fn: CopyFn | None = None,
                 io: UnitIO | None = None, prefetch_slots: int = PREFETCH_SLOTS, progress: bool = False,
                 prepare: Any = None, keep_cache: bool = True):
        """`io`: the store's I/O (it owns it from here and closes it); by default a UnitIO built from `direct_io`,
        `bounce_bytes`, `gds`, `read_fn`, `copy_fn` and `keep_cache`. `prefetch_slots`: slots of a kind that
        prefetched, unused units may hold (Evictor.reserve; PrefetchConfig.slots). `prepare`: what the runtime
        derives from each unit's views (the kernels' repacked weights, runtime/kernels/select.Kernels), built with
        a slot's views and charged to its tier (tier.Prepared)."""
        self.checkpoint, self.placement, self.ledger = checkpoint, placement, ledger
        self.dtype, self.policy, self.stall_timeout = dtype, policy, stall_timeout
        self.io = io if io is not None else UnitIO(checkpoint.index.shards, device, direct_io=direct_io,
                                                   bounce_bytes=bounce_bytes, gds=gds, read_fn=read_fn,
                                                   copy_fn=copy_fn, keep_cache=keep_cache)
        self.files, self.direct_io = self.io.files, self.io.direct_io
        self.stats = StoreStats(io=self.io.counters)
        self._lock = threading.RLock()
        self._host_held: dict[UnitKey, int] = {}  # host-tier references handed to callers (acquire's on_host)
        cuda = device.type == "cuda"
        self.tiers = [Tier(plan.name, device if plan.name == "device" else torch.device("cpu"), set(plan.pinned))
                      for plan in placement.tiers]
        self.compute = self.tiers[0]
        self.host = self.tiers[1] if len(self.tiers) > 1 else None
        # kernel forms go in place only on the compute tier: the host tier's slots are what copies read from
        self.prepared = (Prepared(prepare, ledger, frozenset({self.compute.name})) if prepare is not None
                         else None)
        self.evictor = Evictor(self.tiers, self._lock, self.stats, policy,
                               expert_layers=len({k.layer for k in checkpoint.layouts if k.kind == "expert"}) or 1,
                               expert_floor=max(1, checkpoint.spec.num_experts_per_tok),
                               prefetch_slots=prefetch_slots)
        # kinds GPUDirect reads: those the host tier cannot cache (its slots of the kind are only the staging ones).
        # Where the host can cache, disk -> pinned host slot -> device keeps the unit for later host hits (a pinned
        # copy runs at tens of GB/s, a re-read at disk speed); measured on an H200 (docs/PERF.md): with GPUDirect
        # taking every read, a 50% RAM budget held no expert at all.
        self.gds_kinds = {kind for kind in placement.sizes if not placement.host_caches(kind)}
        self.filler = Filler(checkpoint, self.io, self.evictor, self.compute, self.host, self.gds_kinds, self._lock,
                             self.stats)
        for key, layout in checkpoint.layouts.items():
            if placement.by_rows(key.kind):
                row_tensor(layout)  # a table, or a ConfigError now rather than at the first lookup
        self.pool = None
        self.row_caches: dict[UnitKey, RowCache] = {}
        try:
            for plan, tier in zip(placement.tiers, self.tiers):
                tier.provision(plan, placement.sizes, ledger, pin_memory=cuda and tier.name == "host")
                if self.evictor.expert_policy(tier) == "lru-floor":  # its victims come from the recency heap
                    tier.recency_kinds.add("expert")
            self.row_caches = row_caches(checkpoint, placement, self.compute, ledger)
            self.pool = ReaderPool(threads, self.stats.read_busy)
            self.prefetches = Prefetches(self.compute, self.evictor, self.filler, self.pool, self._lock, self.stats)
            self.row_reader = RowReader(checkpoint, placement, self.compute, self.host, dtype, self.row_caches,
                                        self.io, self.pool, self._wait_any, self._lock, self.stats)
            self.filler.load_pinned(self.tiers, self.pool, stall_timeout, progress)
        except BaseException:
            finish_despite_interrupts(self.close)
            raise

    @property
    def gds(self) -> GdsReader | None:
        """The GPUDirect reader, where reads go NVMe -> GPU (None: they go through host memory)."""
        return self.io.gds

    @property
    def prefetch_slots(self) -> int:
        """Slots of a kind that prefetched, unused units may hold (fixed at construction)."""
        return self.evictor.prefetch_slots

    def _views(self, slot: Slot, key: UnitKey) -> Weights:
        return slot.weights(self.checkpoint.layouts[key], self.dtype, self.prepared)

    # ---- public API -------------------------------------------------------------------------------------
    def acquire(self, keys: Sequence[UnitKey], while_waiting: Callable[[], None] | None = None,
                on_host: Callable[[UnitKey], bool] | None = None,
                after_resident: Callable[[], None] | None = None) -> Iterator[tuple[UnitKey, Weights]]:
        """Yield (key, weights) for every key: resident first, the rest as they land. Release each when done.
        Recency follows the order of `keys` (the last one is the most recently used), not the order the units
        land in: the caller knows which units its sequence used last (runtime.moe.routed_experts).

        while_waiting: called once, on the caller's thread, when every unit handed over so far has been used
        and none of the reads still awaited has landed: the caller's work for that otherwise idle time (the
        runtime computes the next layer's routing ahead, CausalLM._route_ahead). Not counted as I/O wait.

        on_host: for a key the compute tier lacks and the host tier holds, whether the caller computes it there:
        then its host-tier views are handed over (on the host's device) and nothing is copied or read
        (runtime.host_compute).

        after_resident: called once, on the caller's thread, when the units ready at the call have all been
        handed over and before any read is awaited: the caller may hold those and compute them together (one
        grouped kernel), releasing them in this call, so that the reads that follow find the slots as they would
        had each been released as it was used."""
        keys = list(dict.fromkeys(keys))
        ready: list[tuple[UnitKey, Slot]] = []
        waiting: list[UnitKey] = []
        with self._lock:
            stamp = {key: self.evictor.tick + 1 + i for i, key in enumerate(keys)}
            self.evictor.tick += len(keys)
            for key in keys:
                slot = self._take(key, stamp[key])
                if slot is not None:
                    ready.append((key, slot))
                elif (key not in self.compute.resident and on_host is not None
                      and (host_slot := self._host_ready(key)) and on_host(key)):
                    host_slot.refs += 1
                    self._host_held[key] = self._host_held.get(key, 0) + 1
                    self.evictor.touch(host_slot, stamp[key])
                    self.stats.misses[self.compute.name] += 1  # a compute-tier miss the host tier serves
                    self.stats.hits[self.host.name] += 1
                    self.stats.host_computed += 1
                    ready.append((key, host_slot))
                else:
                    waiting.append(key)
        owed = {key for key, _ in ready}  # acquired here, not yet handed to the caller
        inflight: dict[Future, UnitKey] = {}
        own: set[Future] = set()  # reads this call submitted (the others it found in flight)
        retried: set[UnitKey] = set()
        try:
            if waiting:  # start the missing reads now: they proceed while the caller computes the resident units
                self._schedule(waiting, inflight, owed, own)
            for key, slot in ready:
                owed.discard(key)
                yield key, self._views(slot, key)
            if after_resident is not None:
                after_resident()
            while waiting or inflight:
                self._schedule(waiting, inflight, owed, own)
                if not inflight:
                    self._wait_for_a_prefetch(waiting)
                    continue
                if while_waiting is not None and not any(fut.done() for fut in inflight):
                    work, while_waiting = while_waiting, None
                    work()
                for fut in self._wait_any(inflight):
                    key = inflight.pop(fut)
                    owed.discard(key)
                    if fut.cancelled() or fut.exception() is not None:
                        self._read_failed(fut, key, fut in own or key in retried)
                        retried.add(key)
                        waiting.append(key)
                        continue
                    slot = self.compute.resident[key]
                    with self._lock:
                        if slot.loading is fut:
                            slot.loading = None
                        self.evictor.touch(slot, stamp[key])
                    yield key, self._views(slot, key)
        finally:
            # the caller stopped early or a read failed: give back what it never received, and do not start
            # reads nobody waits for any more (their slots are emptied; those already running land and settle)
            for fut, key in inflight.items():
                owed.add(key)
            self._release_quietly(owed)
            self._cancel_unstarted(fut for fut in inflight if fut in own)

    def acquire_ready(self, keys: Sequence[UnitKey]) -> list[Weights] | None:
        """The weights of every unit of `keys` (distinct) if all have landed in the compute tier: acquired, counted
        and stamped as `acquire` does it (release each when done), without its generator; None, acquiring
        nothing, if one has not. A decode step's usual case where the budget holds what it uses (~2 us a unit
        less than `acquire`)."""
        with self._lock:
            resident = self.compute.resident
            slots = [resident.get(key) for key in keys]
            if any(slot is None or slot.loading is not None for slot in slots):
                return None
            tick = self.evictor.tick
            self.evictor.tick += len(keys)
            for i, key in enumerate(keys):
                self._take(key, tick + 1 + i)
        try:  # outside the lock, as acquire builds them (a unit's first views may build its kernel forms)
            return [self._views(slot, key) for slot, key in zip(slots, keys)]
        except BaseException:
            self.release(keys)
            raise

    def count_uses(self, n: int) -> None:
        """n uses of pinned compute-tier units made without acquiring them (runtime/decode_plan.py: pinned units
        never move), counted as hits as `acquire` counts them."""
        with self._lock:
            self.stats.hits[self.compute.name] += n

    def _take(self, key: UnitKey, tick: int) -> Slot | None:
        """The compute tier's landed copy of `key`, referenced, stamped at `tick` and counted as a hit; None where
        it is absent or still being read. Call with the lock held."""
        slot = self.compute.resident.get(key)
        if slot is not None and slot.loading is not None:
            self.evictor.settle(self.compute, slot)
            slot = self.compute.resident.get(key)
        if slot is None or slot.loading is not None:
            return None
        slot.refs += 1
        self.evictor.touch(slot, tick)
        self.stats.hits[self.compute.name] += 1
        self.prefetches.claim(slot, key)
        return slot

    def _wait_any(self, inflight: dict[Future, UnitKey]) -> set[Future]:
        """The reads in `inflight` that finished; an IOStallError once the readers make no progress for the
        stall timeout."""
        start = time.perf_counter()
        try:
            return self.pool.wait_any(list(inflight), self.stall_timeout, [str(k) for k in inflight.values()])
        finally:
            with self._lock:
                self.stats.io_wait_s += time.perf_counter() - start

    def _wait_for_a_prefetch(self, waiting: list[UnitKey]) -> None:
        """Every free slot is taken by prefetches in flight: wait for one to land (it is then evictable)."""
        busy = self.prefetches.in_flight()
        if not busy:
            raise BudgetError(self.compute.name, len(waiting), 0,
                              hint="every slot is held by units not yet released; release units sooner")
        self.pool.wait_any(busy, self.stall_timeout)

    def _read_failed(self, fut: Future, key: UnitKey, ours: bool) -> None:
        """A read this request waited on failed. Its own read (or a retry): report the fault, after emptying the
        slot. A read someone else started (a prefetch, an aborted request): give back the reference; the slot is
        emptied by _schedule, which then reads the unit again for this request."""
        with self._lock:
            slot = self.compute.resident.get(key)
            if slot is not None and slot.loading is fut:
                if ours:
                    self.evictor.drop(self.compute, slot)
                elif slot.refs > 0:
                    slot.refs -= 1
        if ours:
            if fut.cancelled():  # only close() cancels a demand read
                raise EngineClosedError(f"the weight store was closed while {key} was queued for reading")
            raise fut.exception()

    def _cancel_unstarted(self, futures: Iterable[Future]) -> None:
        """Reads queued for a request that ended: cancel those not started, and empty their slots."""
        cancelled = {fut for fut in futures if fut.cancel()}
        if not cancelled:
            return
        with self._lock:
            for slot in list(self.compute.resident.values()):
                if slot.loading in cancelled:
                    self.evictor.settle(self.compute, slot)

    def _schedule(self, waiting: list[UnitKey], inflight: dict[Future, UnitKey], owed: set[UnitKey],
                  own: set[Future]) -> None:
        with self._lock:
            for key in list(waiting):
                slot = self.compute.resident.get(key)
                if slot is not None and slot.refs == 0 and failed(slot.loading):
                    self.evictor.drop(self.compute, slot)  # a read that failed after its requester gave up: retry it
                    slot = None
                if slot is not None:  # resident by now, or a prefetch is reading it
                    slot.refs += 1
                    self.prefetches.claim(slot, key)
                    if slot.loading is None:
                        self.stats.hits[self.compute.name] += 1
                    fut = slot.loading if slot.loading is not None else _done_future()
                else:
                    slot = self.evictor.reserve(self.compute, key)
                    if slot is None:
                        return  # wait for releases or completions
                    self.stats.misses[self.compute.name] += 1
                    if key.kind == "expert":
                        self.stats.expert_reads["demand"] += 1
                    fut = self.pool.submit(DEMAND, partial(self.filler.fill, key, slot), str(key))
                    slot.loading = fut
                    own.add(fut)
                inflight[fut] = key
                owed.add(key)
                waiting.remove(key)

    @property
    def tick(self) -> int:
        """The use counter (one per acquired unit): what `prefetch(used_before=...)` compares with."""
        return self.evictor.tick

    def prefetch(self, keys: Sequence[UnitKey], used_before: int | None = None, limit: int | None = None) -> int:
        """Best effort, asynchronous: start reads of units not yet resident into free or evictable slots, in the
        order given and at most `limit` of them; returns how many it started (Prefetches.start)."""
        return self.prefetches.start(keys, used_before, limit)

    def cancel_prefetch(self, keys: Sequence[UnitKey]) -> int:
        """The routing proved these prefetches wrong: drop those not started that nobody waits for, and mark the
        others stale (the first victims of the next reads). Returns how many it dropped."""
        return self.prefetches.cancel(keys)

    # ---- row kinds (rows.py) --------------------------------------------------------------------------------
    def rows(self, key: UnitKey, ids: torch.Tensor) -> tuple[Weights, torch.Tensor] | None:
        """The rows `ids` look up in a row kind's unit that the compute tier does not hold whole: ({name:
        [distinct ids, width]} on the compute device, `ids` renumbered into them). Gathered from the host tier's
        copy where that tier pins the unit, else read from the checkpoint by the reader pool. None when the
        compute tier holds the unit (or streams it through slots): acquire it instead."""
        return self.row_reader.rows(key, ids)

    def peek(self, key: UnitKey) -> Weights | None:
        """The unit's weights if resident in the compute tier, else None; never reads. Only for use on the
        compute thread before its next acquire (compute-tier evictions happen only there)."""
        with self._lock:
            slot = self.compute.resident.get(key)
            if slot is None or slot.loading is not None:
                return None
        return self._views(slot, key)

    def _host_ready(self, key: UnitKey) -> Slot | None:
        """The host tier's landed copy of `key`, if any (call with the lock held)."""
        if self.host is None:
            return None
        slot = self.host.resident.get(key)
        return slot if slot is not None and slot.loading is None else None

    def release(self, keys: Sequence[UnitKey]) -> None:
        with self._lock:
            for key in keys:
                held = self._host_held.get(key)
                if held:  # handed over from the host tier (acquire's on_host)
                    self._host_held[key] = held - 1
                    if held == 1:
                        del self._host_held[key]
                    slot = self.host.resident.get(key)
                    if slot is not None and slot.refs > 0:
                        slot.refs -= 1
                    continue
                slot = self.compute.resident.get(key)
                if slot is not None and slot.refs > 0:
                    slot.refs -= 1

    def _release_quietly(self, keys) -> None:
        if keys:
            self.release(list(keys))

    def end_request(self) -> int:
        """Called once a request is over, when no caller can hold a unit any more: give back compute-tier
        references still counted (a Ctrl-C landing between a unit's hand-over and the caller's `try` leaks one,
        and the slot could never be evicted again). Workers never hold compute-tier references. Returns how many."""
        leaked = 0
        with self._lock:
            for pool in self.compute.pools.values():
                for slot in pool:
                    if slot.refs:
                        leaked += slot.refs
                        slot.refs = 0
            for key, held in self._host_held.items():  # host-tier units handed over and never released
                slot = self.host.resident.get(key)
                if slot is not None:
                    slot.refs = max(0, slot.refs - held)
                leaked += held
            self._host_held.clear()
        return leaked

    # ---- what it holds and did -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The store's counters (StoreStats.snapshot), its tiers' budgets and peak charges ({"device", "host"};
        on CPU without --vram the one RAM tier is the host tier), and the reads running now."""
        budgets, peak = self.ledger.budgets(), self.ledger.peak()
        return {**self.stats.snapshot(),
                "budget_bytes": {"device": budgets.get("device", 0), "host": budgets.get("host", 0)},
                "peak_bytes": {"device": peak.get("device", 0), "host": peak.get("host", 0)},
                "reads_in_flight": self.stats.read_busy.active,
                # units given kernel forms (in place: in their own slots); declined: dequantized for want of room
                "kernel_units": (self.prepared.counts() if self.prepared
                                 else dict.fromkeys(("built", "in_place", "declined"), 0))}

    def slot_states(self) -> list[SlotState]:
        """Every slot of every tier as it is now (taken under the store's lock: a consistent picture)."""
        with self._lock:
            return [s.state() for t in self.tiers for pool in t.pools.values() for s in pool]

    def resident_keys(self, tier: str = "device") -> set[UnitKey]:
        t = self.compute if tier in ("device", self.compute.name) else self.host
        with self._lock:
            return {k for k, s in t.resident.items() if s.loading is None} if t else set()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.io.close()
        for plan, tier in zip(self.placement.tiers, self.tiers):
            tier.unprovision(plan, self.ledger)


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f
