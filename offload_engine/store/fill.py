"""Filling a reserved slot (the reader threads' jobs): from the host tier's copy when it holds the unit, else
from disk, staged through a host slot that keeps it cached where the host tier has room for the kind (and on
CUDA without GPUDirect, where disk reads land in pinned host memory first). The bytes move through the store's
UnitIO; the slots come from its Evictor."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from functools import partial
from typing import Iterable

from tqdm.auto import tqdm

from ..checkpoint.model import ModelCheckpoint
from ..checkpoint.naming import UnitKey
from ..errors import BudgetError
from .eviction import Evictor
from .readers import DEMAND, ReaderPool
from .stats import StoreStats
from .tier import Slot, Tier
from .unit_io import UnitIO


class Filler:
    def __init__(self, checkpoint: ModelCheckpoint, io: UnitIO, evictor: Evictor, compute: Tier,
                 host: Tier | None, gds_kinds: set[str], lock: threading.RLock, stats: StoreStats):
        self.layouts = checkpoint.layouts
        self.io, self.evictor, self.compute, self.host = io, evictor, compute, host
        self.gds_kinds, self.lock, self.stats = gds_kinds, lock, stats

    def fill(self, key: UnitKey, slot: Slot) -> None:
        """Worker: bring `key` into a compute-tier slot from the host tier if it is there, else from disk."""
        src = None
        if self.host is not None:
            with self.lock:
                cand = self.host.resident.get(key)
                if cand is not None and cand.loading is None:
                    cand.refs += 1
                    src = cand
                    self.stats.hits["host"] += 1
                else:
                    self.stats.misses["host"] += 1
        if src is not None:
            try:
                self.io.copy(src, slot, self.layouts[key].nbytes)
            finally:
                with self.lock:
                    src.refs -= 1
                    self.host.stamp(src, self.evictor.tick)
            return
        if self.host is not None and self.host.pools.get(key.kind) and slot.blob.device.type != "cuda":
            # cache on the host tier on the way up, when it has slots for this kind
            host_slot = self.evictor.reserve(self.host, key)
            if host_slot is not None:
                self._stage(key, host_slot, slot)
                return
        self.read_disk(key, slot)

    def prefetch_fill(self, key: UnitKey, slot: Slot) -> None:
        """Worker: `fill` for a prefetch. A failed one forgets the unit when nobody waits on it (a demand read
        then reports the fault); a landed one nobody waits on is an ordinary resident unit at once."""
        try:
            self.fill(key, slot)
        except BaseException:
            with self.lock:
                self.stats.prefetch_failed += 1
                if slot.refs == 0:
                    self.evictor.drop(self.compute, slot)
            raise
        with self.lock:
            if slot.refs == 0 and slot.loading is not None:
                slot.loading = None

    def read_disk(self, key: UnitKey, slot: Slot) -> None:
        """Disk -> `slot`: a host-memory slot directly; a device slot by GPUDirect for the kinds it reads, else
        through a host slot."""
        layout = self.layouts[key]
        if slot.blob.device.type == "cuda":
            slot.offset = 0
            if self.io.gds is not None and key.kind in self.gds_kinds:  # GPUDirect: NVMe straight into the slot
                self.io.read_gds(layout, slot)
            else:
                self._read_via_host(key, slot)
            return
        self.io.read(layout, slot)

    def _read_via_host(self, key: UnitKey, slot: Slot) -> None:
        """CUDA without GPUDirect: disk -> a host slot (cached there when the host tier has room) -> device."""
        host_slot = self.evictor.reserve(self.host, key) if self.host else None
        if host_slot is None:
            raise BudgetError("host", self.layouts[key].nbytes, 0,
                              hint="CUDA reads need a host slot for the unit kind as staging")
        self._stage(key, host_slot, slot)

    def _stage(self, key: UnitKey, host_slot: Slot, slot: Slot) -> None:
        """Disk -> a reserved host slot (which keeps the unit cached) -> the compute-tier slot."""
        try:
            self.read_disk(key, host_slot)
        except BaseException:  # half read: the host slot must not serve this unit to a later request
            self.evictor.drop(self.host, host_slot)
            raise
        try:
            self.io.copy(host_slot, slot, self.layouts[key].nbytes)
        finally:
            with self.lock:
                host_slot.loading, host_slot.refs = None, host_slot.refs - 1

    def load_pinned(self, tiers: Iterable[Tier], pool: ReaderPool, stall_timeout: float, progress: bool) -> None:
        """Read every unit of the kinds each tier pins into its slots (at open)."""
        jobs = []
        for tier in tiers:
            for kind in tier.pinned_kinds:
                keys = [k for k in self.layouts if k.kind == kind]
                for key, slot in zip(keys, tier.pools[kind]):
                    tier.place(slot, key)
                    jobs.append((key, slot))
        total = sum(self.layouts[k].nbytes for k, _ in jobs)
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not progress) as bar:
            futures = {pool.submit(DEMAND, partial(self.read_disk, key, slot), str(key)): key for key, slot in jobs}
            for fut in _as_completed(futures, stall_timeout, pool, [str(k) for k, _ in jobs]):
                fut.result()
                bar.update(self.layouts[futures[fut]].nbytes)


def _as_completed(futures, timeout: float, pool: ReaderPool, waited_for: list[str]):
    pending: set[Future] = set(futures)
    while pending:
        done = pool.wait_any(pending, timeout, waited_for)
        pending -= done
        yield from done
