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
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..checkpoint.index import DTYPES
from ..checkpoint.layout import ReadRange, UnitLayout
from ..checkpoint.model import ModelCheckpoint
from ..checkpoint.naming import UnitKey
from ..interrupts import finish_despite_interrupts
from ..errors import BudgetError, EngineClosedError
from ..planner.placement import Placement
from ..runtime.weights import Weights
from .disk import (BOUNCE_BYTES, PAGE_DIRECT, DirectAlign, ShardFiles, direct_alignment, drop_cache, open_direct,
                   read_range, read_range_direct, read_unit_direct)
from .gds import GdsReader
from .ledger import Ledger
from .policy import Usage, aged_count, choose_victim, layer_to_evict, may_take, resolved
from .readers import DEMAND, PREFETCH, BusyClock, ReaderPool, reading
from .rows import RowCache, plan_rows, row_bytes, row_tensor, split
from .tier import Slot, Tier

PREFETCH_SLOTS = 8  # default quota of prefetched, unused units per kind (_reserve; PrefetchConfig.slots)
ReadFn = Callable[[ShardFiles, ReadRange, torch.Tensor], None]


@dataclass
class StoreStats:
    hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    misses: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    bytes_read_disk: int = 0
    bytes_host_to_device: int = 0
    io_wait_s: float = 0.0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0  # prefetched and evicted unused
    prefetch_cancelled: int = 0  # prefetches dropped before they started (routing proved them stale)
    prefetch_failed: int = 0  # prefetch reads that raised (the unit is dropped; a demand read retries it)
    rows: dict[str, int] = field(default_factory=lambda: {"cached": 0, "read": 0})  # row lookups (store.rows)
    # expert units requests needed read, by whom: a prefetch (read ahead, then used) or the request (on demand)
    expert_reads: dict[str, int] = field(default_factory=lambda: {"ahead": 0, "demand": 0})
    host_computed: int = 0  # units handed over from the host tier for the caller to compute there (host_compute)
    read_busy: BusyClock = field(default_factory=BusyClock, repr=False)  # the reader pool's busy time

    def snapshot(self) -> dict:
        return {"hits": dict(self.hits), "misses": dict(self.misses), "bytes_read_disk": self.bytes_read_disk,
                "bytes_host_to_device": self.bytes_host_to_device, "io_wait_s": self.io_wait_s,
                "prefetch_issued": self.prefetch_issued, "prefetch_used": self.prefetch_used,
                "prefetch_wasted": self.prefetch_wasted, "prefetch_cancelled": self.prefetch_cancelled,
                "prefetch_failed": self.prefetch_failed, "rows": dict(self.rows),
                "expert_reads": dict(self.expert_reads), "host_computed": self.host_computed,
                "read_busy_s": self.read_busy.seconds()}


class TieredStore:
    def __init__(self, checkpoint: ModelCheckpoint, placement: Placement, ledger: Ledger, device: torch.device,
                 dtype: torch.dtype, *, policy: str = "lru-floor", direct_io: bool = False, threads: int = 4,
                 bounce_bytes: int = BOUNCE_BYTES, gds: bool = True, stall_timeout: float = 60.0,
                 read_fn: ReadFn | None = None, progress: bool = False):
        self.checkpoint, self.placement, self.ledger = checkpoint, placement, ledger
        self.dtype, self.policy, self.stall_timeout = dtype, policy, stall_timeout
        self.stats = StoreStats()
        # layer-lru gives each MoE layer an equal share of a tier's expert slots; lru-floor leaves each layer the
        # experts a token routes to
        self._expert_layers = len({k.layer for k in checkpoint.layouts if k.kind == "expert"}) or 1
        self._expert_floor = max(1, checkpoint.spec.num_experts_per_tok)
        self._lock = threading.RLock()
        self._tick = 0
        self._host_held: dict[UnitKey, int] = {}  # host-tier references handed to callers (acquire's on_host)
        self.prefetch_slots = PREFETCH_SLOTS  # per kind: slots prefetched, unused units may hold (see _reserve)
        self.files = ShardFiles(checkpoint.index.shards)
        self._read_fn = read_fn or read_range
        self._direct_fds: dict = {}
        self._direct_aligns: dict[os.PathLike, DirectAlign] = {}  # what O_DIRECT asks of each file opened so
        self.direct_io = direct_io
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        # a read_fn defines the disk read (fault injection): GPUDirect would go around it
        self.gds = GdsReader.open(self.files) if cuda and gds and read_fn is None else None
        self.tiers: list[Tier] = []
        for plan in placement.tiers:
            tier_device = device if plan.name == "device" else torch.device("cpu")
            tier = Tier(plan.name, tier_device, set(plan.pinned))
            self.tiers.append(tier)
        self.compute = self.tiers[0]
        self.host = self.tiers[1] if len(self.tiers) > 1 else None
        # kinds GPUDirect reads: those the host tier cannot cache (its slots of the kind are only the staging ones).
        # Where the host can cache, disk -> pinned host slot -> device keeps the unit for later host hits (a pinned
        # copy runs at tens of GB/s, a re-read at disk speed); measured on an H200 (docs/PERF.md): with GPUDirect
        # taking every read, a 50% RAM budget held no expert at all.
        self.gds_kinds = {kind for kind in placement.sizes if not placement.host_caches(kind)}
        for key, layout in checkpoint.layouts.items():
            if placement.by_rows(key.kind):
                row_tensor(layout)  # a table, or a ConfigError now rather than at the first lookup
        self.pool = None
        self.row_caches: dict[UnitKey, RowCache] = {}
        try:
            for plan, tier in zip(placement.tiers, self.tiers):
                if plan.staging_bytes:
                    ledger.charge(tier.name, plan.staging_bytes, "staging")
                if plan.kv_bytes:
                    ledger.charge(tier.name, plan.kv_bytes, "kv cache")
                for kind, n in plan.slots.items():
                    tier.allocate(kind, n, placement.sizes[kind].slot_bytes, ledger,
                                  pin_memory=cuda and tier.name == "host")
                if self._expert_policy(tier) == "lru-floor":  # its victims come from the tier's recency heap
                    tier.recency_kinds.add("expert")
            self.row_caches = self._row_caches(ledger)
            self.pool = ReaderPool(threads, bounce_bytes if direct_io else 0, self.stats.read_busy)
            self._load_pinned(progress)
        except BaseException:
            finish_despite_interrupts(self.close)
            raise

    def _row_caches(self, ledger: Ledger) -> dict[UnitKey, RowCache]:
        """A RowCache per unit read by rows, sharing the compute tier's row cache bytes (charged here)."""
        nbytes = self.placement.compute.row_cache_bytes
        keys = [k for k in self.checkpoint.layouts if self.placement.by_rows(k.kind)]
        if not nbytes or not keys:
            return {}
        ledger.charge(self.compute.name, nbytes, "row cache")
        caches = {}
        for key in keys:
            size = row_bytes(row_tensor(self.checkpoint.layouts[key]))
            caches[key] = RowCache(nbytes // len(keys) // size, size, self.compute.device)
        return caches

    # ---- loading ----------------------------------------------------------------------------------------
    def _load_pinned(self, progress: bool) -> None:
        jobs = []
        for tier in self.tiers:
            for kind in tier.pinned_kinds:
                keys = [k for k in self.checkpoint.layouts if k.kind == kind]
                for key, slot in zip(keys, tier.pools[kind]):
                    tier.place(slot, key)
                    jobs.append((key, slot))
        total = sum(self.checkpoint.layouts[k].nbytes for k, _ in jobs)
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not progress) as bar:
            futures = {self.pool.submit(DEMAND, partial(self._read_disk, key, slot), str(key)): key
                       for key, slot in jobs}
            for fut in _as_completed(futures, self.stall_timeout, self.pool, [str(k) for k, _ in jobs]):
                fut.result()
                bar.update(self.checkpoint.layouts[futures[fut]].nbytes)

    def _read_disk(self, key: UnitKey, slot: Slot) -> None:
        layout = self.checkpoint.layouts[key]
        if slot.blob.device.type == "cuda":
            slot.offset = 0
            if self.gds is not None and key.kind in self.gds_kinds:  # GPUDirect: NVMe straight into the slot
                for r in layout.read_ranges():
                    with reading(r.file, r.file_offset, r.nbytes):
                        self.gds.read(r, slot.blob)
                with self._lock:
                    self.stats.bytes_read_disk += layout.nbytes
            else:
                self._read_via_host(key, slot)
            return
        slot.offset = self._read_unit_direct(layout, slot.blob) if self.direct_io else None
        if slot.offset is None:
            slot.offset = 0
            self._read_ranges(layout.read_ranges(), slot.blob)
        with self._lock:
            self.stats.bytes_read_disk += layout.nbytes

    def _read_unit_direct(self, layout: UnitLayout, blob: torch.Tensor) -> int | None:
        """O_DIRECT straight into the slot (no bounce copy) when the unit allows it: the offset of its bytes."""
        r = layout.single_range
        fd = self._direct_fd(r.file) if r is not None else None
        return None if fd is None else read_unit_direct(fd, layout, blob, self.files, self._direct_aligns[r.file])

    def _read_ranges(self, ranges: Iterable[ReadRange], blob: torch.Tensor) -> None:
        for r in ranges:
            # the range is recorded around the whole read function too, so a read_fn that blocks before it
            # reaches the disk is still reported by file and offset (the disk readers record finer ranges)
            with reading(r.file, r.file_offset, r.nbytes):
                self._read_range(r, blob)

    def _read_range(self, r: ReadRange, blob: torch.Tensor) -> None:
        if self.direct_io:
            fd = self._direct_fd(r.file)
            if fd is not None:
                read_range_direct(fd, r, blob, self.pool.bounce(), self.files)
                return
        self._read_fn(self.files, r, blob)
        if self.direct_io:  # O_DIRECT refused by the filesystem: at least drop the pages we read
            drop_cache(self.files.fd(r.file), r.file_offset, r.nbytes)

    def _read_via_host(self, key: UnitKey, slot: Slot) -> None:
        """CUDA without GPUDirect: disk -> a host slot (cached there when the host tier has room) -> device."""
        host_slot = self._reserve(self.host, key) if self.host else None
        if host_slot is None:
            raise BudgetError("host", self.checkpoint.layouts[key].nbytes, 0,
                              hint="CUDA reads need a host slot for the unit kind as staging")
        self._stage(key, host_slot, slot)

    def _stage(self, key: UnitKey, host_slot: Slot, slot: Slot) -> None:
        """Disk -> a reserved host slot (which keeps the unit cached) -> the compute-tier slot."""
        try:
            self._read_disk(key, host_slot)
        except BaseException:  # half read: the host slot must not serve this unit to a later request
            self._drop(self.host, host_slot)
            raise
        try:
            self._copy(host_slot, slot, key)
        finally:
            with self._lock:
                host_slot.loading, host_slot.refs = None, host_slot.refs - 1

    def _direct_fd(self, path):
        """Cached O_DIRECT descriptor (None: refused by the filesystem); checked against the index's identity."""
        with self._lock:
            if path not in self._direct_fds:
                fd = self._direct_fds[path] = open_direct(path, self.files)
                self._direct_aligns[path] = direct_alignment(fd) if fd is not None else PAGE_DIRECT
            return self._direct_fds[path]

    def _copy(self, src: Slot, dst: Slot, key: UnitKey) -> None:
        """Host slot -> device slot. On CUDA: an async copy from pinned memory on the store's copy stream; the
        reader thread waits on its event, so the compute stream never blocks on transfers it does not need."""
        n = self.checkpoint.layouts[key].nbytes
        dst.offset = 0
        source = src.blob[src.offset:src.offset + n]
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                dst.blob[:n].copy_(source, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            done.synchronize()
        else:
            dst.blob[:n].copy_(source)
        with self._lock:
            self.stats.bytes_host_to_device += n

    def _fill(self, key: UnitKey, slot: Slot) -> None:
        """Worker: bring `key` into a compute-tier slot from the host tier if it is there, else from disk."""
        src = None
        if self.host is not None:
            with self._lock:
                cand = self.host.resident.get(key)
                if cand is not None and cand.loading is None:
                    cand.refs += 1
                    src = cand
                    self.stats.hits["host"] += 1
                else:
                    self.stats.misses["host"] += 1
        if src is not None:
            try:
                self._copy(src, slot, key)
            finally:
                with self._lock:
                    src.refs -= 1
                    self.host.stamp(src, self._tick)
            return
        if self.host is not None and self.host.pools.get(key.kind) and slot.blob.device.type != "cuda":
            # cache on the host tier on the way up, when it has slots for this kind
            host_slot = self._reserve(self.host, key)
            if host_slot is not None:
                self._stage(key, host_slot, slot)
                return
        self._read_disk(key, slot)

    # ---- slots --------------------------------------------------------------------------------------------
    def _reserve(self, tier: Tier, key: UnitKey, used_before: int | None = None,
                 prefetching: bool = False) -> Slot | None:
        """A slot of `tier` for `key` (refs=1, marked loading), evicting per policy; None if all are busy.
        A stale prefetch (a guess its layer's routing did not use) is the first victim of any read. A prefetch
        (`prefetching`) evicts a cached unit only while fewer than `prefetch_slots` slots of the kind hold
        prefetched, unused units, and then never one used since `used_before` (a tick); past that quota it
        recycles stale guesses only. So wrong guesses never push out more of the cache than the quota, and a
        right guess (kept by the cache) frees its quota place at the eviction a demand miss would have made. A
        prefetch never evicts a unit prefetched and not yet judged (the layer after next must not throw away the
        next layer's unit)."""
        with self._lock:
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
            tier.stamp(slot, self._tick)  # not the evicted unit's age: landed, it is stamped by its acquire
            slot.loading = Future()  # placeholder until the real future is attached
            return slot

    def _stale_victim(self, tier: Tier, kind: str) -> Slot | None:
        """The least recently used stale prefetch nobody holds (call with the lock held)."""
        best = None
        for s in tier.flagged(tier.stale, kind, "stale"):
            if s.loading is not None:
                self._settle(tier, s)
            if s.stale and s.key is not None and not s.refs and s.loading is None:
                if best is None or s.last_use < best.last_use:
                    best = s
        return best

    def _layer_share(self, tier: Tier, kind: str) -> int:
        """Slots of `kind` per MoE layer in `tier` (layer-lru's share)."""
        return max(1, len(tier.pools.get(kind, [])) // self._expert_layers)

    def _expert_policy(self, tier: Tier) -> str:
        """The eviction rule `tier`'s expert cache runs under (policy.resolved: lru-floor needs room)."""
        return resolved(self.policy, self._layer_share(tier, "expert"), self._expert_floor)

    def _victim(self, tier: Tier, key: UnitKey, used_before: int | None, prefetching: bool) -> Slot | None:
        """The unit to evict per policy, among evictable ones (call with the lock held). layer-lru looks at the
        incoming unit's layer and at the layer holding the most slots, not at every slot (O(slots per layer) per
        miss); lru-floor walks the tier's recency heap from its least recent end; the other policies, and these
        two when those find nothing, scan the pool."""
        pool = tier.pools.get(key.kind, [])
        share, floor = self._layer_share(tier, key.kind), self._expert_floor
        # the policy governs expert caches; the few streaming slots of other kinds are plain LRU
        policy = self._expert_policy(tier) if key.kind == "expert" else "lru"

        def usable(s: Slot) -> bool:
            if s.loading is not None:
                self._settle(tier, s)
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
                return pool[choose_victim("lru", candidates, key.layer, share, self._tick)]
        if policy == "lru-floor":  # the least recent unit it may take, from the tier's recency heap
            oldest = tier.least_recent(key.kind, lambda s: usable(s) and may_take(s.key.layer, key.layer, floor,
                                                                                  occupied))
            if oldest is not None:
                return oldest
        candidates = evictable(pool)
        if not candidates:
            return None
        return pool[choose_victim(policy, candidates, key.layer, share, self._tick, floor, occupied)]

    def _settle(self, tier: Tier, slot: Slot) -> None:
        """A read nobody waits for any more (its request failed or stopped early) has finished: a landed unit
        becomes an ordinary resident (evictable) one, a failed or cancelled one frees its slot. Call with the
        lock held."""
        fut = slot.loading
        if fut is None or slot.refs or not fut.done():
            return
        if _failed(fut):
            self._drop(tier, slot)
        else:
            slot.loading = None

    def _drop(self, tier: Tier, slot: Slot) -> None:
        with self._lock:
            if slot.key is not None:
                tier.unplace(slot)
                tier.free.setdefault(slot.kind, []).append(slot)
            slot.key, slot.refs, slot.loading, slot.prefetched, slot.stale = None, 0, None, False, False

    def _touch(self, slot: Slot, tick: int) -> None:
        slot.score = aged_count(slot.score, slot.last_use, tick) + 1.0
        (self.compute if slot.tier == self.compute.name else self.host).stamp(slot, tick)

    def _views(self, slot: Slot, key: UnitKey) -> Weights:
        cached = slot.views
        if cached is None or cached[0] != (key, slot.offset):
            views = self.checkpoint.layouts[key].views(slot.blob[slot.offset:])
            cast = frozenset(k for k, v in views.items() if v.is_floating_point() and v.dtype != self.dtype)
            cached = slot.views = ((key, slot.offset), views, cast)
        _, views, cast = cached
        # a copy: callers may rebind entries, never the slot's cached views
        return {k: (v.to(self.dtype) if k in cast else v) for k, v in views.items()} if cast else dict(views)

    # ---- public API -------------------------------------------------------------------------------------
    def acquire(self, keys: Sequence[UnitKey], while_waiting: Callable[[], None] | None = None,
                on_host: Callable[[UnitKey], bool] | None = None) -> Iterator[tuple[UnitKey, Weights]]:
        """Yield (key, weights) for every key: resident first, the rest as they land. Release each when done.
        Recency follows the order of `keys` (the last one is the most recently used), not the order the units
        land in: the caller knows which units its sequence used last (runtime.moe.routed_experts).

        while_waiting: called once, on the caller's thread, when every unit handed over so far has been used
        and none of the reads still awaited has landed: the caller's work for that otherwise idle time (the
        runtime computes the next layer's routing ahead, CausalLM._route_ahead). Not counted as I/O wait.

        on_host: for a key the compute tier lacks and the host tier holds, whether the caller computes it there:
        then its host-tier views are handed over (on the host's device) and nothing is copied or read
        (runtime.host_compute)."""
        keys = list(dict.fromkeys(keys))
        ready: list[tuple[UnitKey, Slot]] = []
        waiting: list[UnitKey] = []
        with self._lock:
            stamp = {key: self._tick + 1 + i for i, key in enumerate(keys)}
            self._tick += len(keys)
            for key in keys:
                slot = self.compute.resident.get(key)
                if slot is not None:
                    self._settle(self.compute, slot)
                    slot = self.compute.resident.get(key)
                if slot is not None and slot.loading is None:
                    slot.refs += 1
                    self._touch(slot, stamp[key])
                    self.stats.hits[self.compute.name] += 1
                    self._claim_prefetched(slot, key)
                    ready.append((key, slot))
                elif slot is None and on_host is not None and (host_slot := self._host_ready(key)) and on_host(key):
                    host_slot.refs += 1
                    self._host_held[key] = self._host_held.get(key, 0) + 1
                    self._touch(host_slot, stamp[key])
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
                        self._touch(slot, stamp[key])
                    yield key, self._views(slot, key)
        finally:
            # the caller stopped early or a read failed: give back what it never received, and do not start
            # reads nobody waits for any more (their slots are emptied; those already running land and settle)
            for fut, key in inflight.items():
                owed.add(key)
            self._release_quietly(owed)
            self._cancel_unstarted(fut for fut in inflight if fut in own)

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
        busy = self._prefetches_in_flight()
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
                    self._drop(self.compute, slot)
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
                    self._settle(self.compute, slot)

    def _schedule(self, waiting: list[UnitKey], inflight: dict[Future, UnitKey], owed: set[UnitKey],
                  own: set[Future]) -> None:
        with self._lock:
            for key in list(waiting):
                slot = self.compute.resident.get(key)
                if slot is not None and slot.refs == 0 and _failed(slot.loading):
                    self._drop(self.compute, slot)  # a read that failed after its requester gave up: retry it
                    slot = None
                if slot is not None:  # resident by now, or a prefetch is reading it
                    slot.refs += 1
                    self._claim_prefetched(slot, key)
                    if slot.loading is None:
                        self.stats.hits[self.compute.name] += 1
                    fut = slot.loading if slot.loading is not None else _done_future()
                else:
                    slot = self._reserve(self.compute, key)
                    if slot is None:
                        return  # wait for releases or completions
                    self.stats.misses[self.compute.name] += 1
                    if key.kind == "expert":
                        self.stats.expert_reads["demand"] += 1
                    fut = self.pool.submit(DEMAND, partial(self._fill, key, slot), str(key))
                    slot.loading = fut
                    own.add(fut)
                inflight[fut] = key
                owed.add(key)
                waiting.remove(key)

    def _claim_prefetched(self, slot: Slot, key: UnitKey) -> None:
        """A request uses the unit a prefetch read (or is reading) into `slot`: it joins the cache, and counts as
        a read made ahead. Call with the lock held."""
        if slot.prefetched:
            slot.prefetched = slot.stale = False
            self.stats.prefetch_used += 1
            if key.kind == "expert":
                self.stats.expert_reads["ahead"] += 1

    def _prefetches_in_flight(self, kind: str | None = None) -> list[Future]:
        with self._lock:
            kinds = [kind] if kind is not None else list(self.compute.prefetched)
            return [s.loading for k in kinds for s in self.compute.flagged(self.compute.prefetched, k, "prefetched")
                    if s.loading is not None]

    @property
    def tick(self) -> int:
        """The use counter (one per acquired unit): what `prefetch(used_before=...)` compares with."""
        return self._tick

    def prefetch(self, keys: Sequence[UnitKey], used_before: int | None = None, limit: int | None = None) -> int:
        """Best effort, asynchronous: start reads of units not yet resident into free or evictable slots (see
        _reserve for which), in the order given and at most `limit` of them. Never evicts a unit in use or in
        flight, and never holds more than half of a kind's slots, so demand reads always find room; returns how
        many reads it started."""
        started, full = 0, set()  # kinds with no slot to spare in this call
        with self._lock:
            for key in keys:
                if limit is not None and started >= limit:
                    break
                pool = self.compute.pools.get(key.kind)
                if key in self.compute.resident or not pool or key.kind in full:
                    continue
                if len(self._prefetches_in_flight(key.kind)) >= max(1, len(pool) // 2):
                    continue
                slot = self._reserve(self.compute, key, used_before, prefetching=True)
                if slot is None:
                    full.add(key.kind)  # this kind's slots are all busy or warm; another kind's may not be
                    continue
                # as recent as the latest use: otherwise it keeps its victim's age and is the next victim itself
                slot.refs, slot.prefetched = 0, True
                self.compute.stamp(slot, self._tick)
                self.compute.prefetched.setdefault(key.kind, {})[slot.index] = slot
                slot.loading = self.pool.submit(PREFETCH, partial(self._prefetch_fill, key, slot), str(key))
                self.stats.prefetch_issued += 1
                started += 1
        return started

    def cancel_prefetch(self, keys: Sequence[UnitKey]) -> int:
        """The routing proved these prefetches wrong: drop those not started that nobody waits for, and mark the
        others stale (the first victims of the next reads)."""
        cancelled = 0
        with self._lock:
            for key in keys:
                slot = self.compute.resident.get(key)
                if slot is None or not slot.prefetched:
                    continue
                if slot.refs == 0 and slot.loading is not None and slot.loading.cancel():
                    self._drop(self.compute, slot)
                    self.stats.prefetch_cancelled += 1
                    cancelled += 1
                else:
                    slot.stale = True
                    self.compute.stale.setdefault(key.kind, {})[slot.index] = slot
        return cancelled

    # ---- row kinds (rows.py) --------------------------------------------------------------------------------
    def rows(self, key: UnitKey, ids: torch.Tensor) -> tuple[Weights, torch.Tensor] | None:
        """The rows `ids` look up in a row kind's unit that the compute tier does not hold whole: ({name:
        [distinct ids, width]} on the compute device, `ids` renumbered into them). Gathered from the host tier's
        copy where that tier pins the unit, else read from the checkpoint by the reader pool. None when the
        compute tier holds the unit (or streams it through slots): acquire it instead."""
        layout = self.checkpoint.layouts[key]
        host_copy = self.host is not None and key.kind in self.host.pinned_kinds
        if key.kind in self.compute.pinned_kinds or not (host_copy or self.placement.by_rows(key.kind)):
            return None
        req = plan_rows(layout, ids)
        if host_copy:
            slot = self.host.resident[key]
            table = layout.views(slot.blob[slot.offset:])[req.tensor.local][torch.tensor(req.rows)]
        else:
            raw = self._rows_raw(key, layout, req.rows)
            table = raw.view(DTYPES[req.tensor.dtype][1]).view(len(req.rows), req.tensor.shape[1])
        if table.is_floating_point() and table.dtype != self.dtype:
            table = table.to(self.dtype)
        return {req.tensor.local: table.to(self.compute.device)}, req.local_ids.to(ids.device)

    def _rows_raw(self, key: UnitKey, layout: UnitLayout, rows: list[int]) -> torch.Tensor:
        """The bytes of `rows` (distinct ids, ascending) as [len(rows), row bytes]: those in the row cache from
        there, the others read from the checkpoint (and cached)."""
        cache = self.row_caches.get(key)
        cached, slots, missing = cache.lookup(rows) if cache is not None else ([], [], list(range(len(rows))))
        ids = [rows[i] for i in missing]
        with self._lock:
            self.stats.rows["cached"] += len(cached)
            self.stats.rows["read"] += len(ids)
        size = row_bytes(row_tensor(layout))
        with torch.inference_mode(False):  # reader threads write into it, outside inference mode
            read = torch.empty(len(ids), size, dtype=torch.uint8)
        if ids:
            self._read_row_ranges(key, plan_rows(layout, torch.tensor(ids)).ranges, read.view(-1))
        if cache is None:
            return read
        out = torch.empty(len(rows), size, dtype=torch.uint8, device=cache.buffer.device)
        if cached:
            out[cached] = cache.buffer[slots]
        if ids:
            read = read.to(out.device)
            out[missing] = read
            cache.insert(ids, read)
        return out

    def _read_row_ranges(self, key: UnitKey, ranges: list[ReadRange], blob: torch.Tensor) -> None:
        """Read `ranges` into `blob` on the reader pool (split across its threads), waiting like a demand miss:
        an IOFault names the shard and offset, an IOStallError fires after stall_timeout without progress."""
        inflight = {self.pool.submit(DEMAND, partial(self._read_ranges, group, blob), f"{key} rows"): key
                    for group in split(ranges, self.pool.threads)}
        try:
            while inflight:
                for fut in self._wait_any(inflight):
                    del inflight[fut]
                    if fut.cancelled():
                        raise EngineClosedError(f"the weight store was closed while {key}'s rows were queued")
                    if fut.exception() is not None:
                        raise fut.exception()
        finally:
            for fut in inflight:  # a failed request starts no more reads; running ones fill a buffer now unused
                fut.cancel()
        with self._lock:
            self.stats.bytes_read_disk += sum(r.nbytes for r in ranges)

    def peek(self, key: UnitKey) -> Weights | None:
        """The unit's weights if resident in the compute tier, else None; never reads. Only for use on the
        compute thread before its next acquire (compute-tier evictions happen only there)."""
        with self._lock:
            slot = self.compute.resident.get(key)
            if slot is None or slot.loading is not None:
                return None
        return self._views(slot, key)

    def _prefetch_fill(self, key: UnitKey, slot: Slot) -> None:
        try:
            self._fill(key, slot)
        except BaseException:
            with self._lock:
                self.stats.prefetch_failed += 1
                if slot.refs == 0:  # nobody waits on it: forget the unit; a demand read will report the fault
                    self._drop(self.compute, slot)
            raise
        with self._lock:
            if slot.refs == 0 and slot.loading is not None:
                slot.loading = None

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

    def resident_keys(self, tier: str = "device") -> set[UnitKey]:
        t = self.compute if tier in ("device", self.compute.name) else self.host
        with self._lock:
            return {k for k, s in t.resident.items() if s.loading is None} if t else set()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.files.close()
        if self.gds is not None:
            self.gds.close()
        while self._direct_fds:  # popped first: a rerun after an interrupt never closes a descriptor twice
            _, fd = self._direct_fds.popitem()
            if fd is not None:
                os.close(fd)
        for plan, tier in zip(self.placement.tiers, self.tiers):
            tier.free_all(self.ledger)
            items = self.ledger.accounts[tier.name].items
            for what, n in (("staging", plan.staging_bytes), ("kv cache", plan.kv_bytes),
                            ("row cache", plan.row_cache_bytes)):
                if n and items.get(what):
                    self.ledger.credit(tier.name, n, what)


def _failed(fut: Future | None) -> bool:
    return fut is not None and fut.done() and (fut.cancelled() or fut.exception() is not None)


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


def _as_completed(futures, timeout: float, pool: ReaderPool, waited_for: list[str]):
    pending = set(futures)
    while pending:
        done = pool.wait_any(pending, timeout, waited_for)
        pending -= done
        yield from done
