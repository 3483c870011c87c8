"""Row kinds (the embedding) read by rows: a lookup needs one row per token, never the whole table.

Where the placement pins a row kind nowhere (Placement.by_rows) it gets no slot; a forward's distinct token ids
become byte ranges of the checkpoint (adjacent ids merged), read into a fresh buffer by the store's readers,
and the lookup runs on those rows with the ids renumbered into them: the same gather, the same bits. The rows
looked up last stay in a RowCache (charged to the compute tier by the placement: ROW_CACHE_BYTES), so a step
whose token was seen lately reads nothing.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ..checkpoint.index import DTYPES
from ..checkpoint.layout import ReadRange, TensorSlice, UnitLayout
from ..checkpoint.model import ModelCheckpoint
from ..checkpoint.naming import UnitKey
from ..errors import ConfigError, EngineClosedError
from ..planner.placement import Placement
from .ledger import Ledger
from .readers import DEMAND, ReaderPool
from .stats import StoreStats
from .tier import Tier
from .unit_io import UnitIO
from .weights import Weights


@dataclass(frozen=True)
class RowRequest:
    tensor: TensorSlice  # the unit's one 2-D tensor
    rows: list[int]  # distinct row ids, ascending
    local_ids: torch.Tensor  # the lookup's ids renumbered into `rows`
    ranges: list[ReadRange]  # runs of adjacent rows; blob offsets into a buffer of len(rows) rows

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)


def row_tensor(layout: UnitLayout) -> TensorSlice:
    """The one 2-D tensor of a row kind's unit (a table indexed by token id)."""
    if len(layout.slices) != 1 or len(layout.slices[0].shape) != 2:
        raise ConfigError(f"{layout.key} must be one 2-D table to be read by rows; it holds "
                          f"{[(s.local, s.shape) for s in layout.slices]}")
    return layout.slices[0]


def row_bytes(tensor: TensorSlice) -> int:
    """Bytes of one row of a row kind's table."""
    return tensor.nbytes // tensor.shape[0]


def plan_rows(layout: UnitLayout, ids: torch.Tensor) -> RowRequest:
    tensor = row_tensor(layout)
    count = tensor.shape[0]
    unique, local = torch.unique(ids.cpu(), return_inverse=True)
    rows = unique.tolist()
    if rows and (rows[0] < 0 or rows[-1] >= count):
        bad = rows[0] if rows[0] < 0 else rows[-1]
        raise IndexError(f"token id {bad} is outside {layout.key}'s {count} rows ({tensor.local} in {tensor.file})")
    size = row_bytes(tensor)
    ranges: list[ReadRange] = []
    start = 0
    for i in range(1, len(rows) + 1):  # one range per run of consecutive ids
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            ranges.append(ReadRange(tensor.file, tensor.file_offset + rows[start] * size, (i - start) * size,
                                    start * size))
            start = i
    return RowRequest(tensor, rows, local.view(ids.shape), ranges)


def split(ranges: list[ReadRange], parts: int) -> list[list[ReadRange]]:
    """At most `parts` groups of about equal bytes, for the reader threads (a prefill reads many rows)."""
    total = sum(r.nbytes for r in ranges)
    groups: list[list[ReadRange]] = [[]]
    done = 0
    for r in ranges:
        if groups[-1] and done >= total * len(groups) / parts:
            groups.append([])
        groups[-1].append(r)
        done += r.nbytes
    return groups


class RowCache:
    """The last `capacity` distinct rows of one table looked up (least recently used out), as raw bytes in one
    [capacity, row size] buffer on the compute device."""

    def __init__(self, capacity: int, size: int, device: torch.device):
        self.buffer = torch.empty(capacity, size, dtype=torch.uint8, device=device)
        self._where: OrderedDict[int, int] = OrderedDict()  # row id -> buffer row, least recently used first

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0]

    def lookup(self, rows: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(positions in `rows` cached, their buffer rows, positions to read)."""
        cached, slots, missing = [], [], []
        for i, row in enumerate(rows):
            slot = self._where.get(row)
            if slot is None:
                missing.append(i)
            else:
                self._where.move_to_end(row)
                cached.append(i)
                slots.append(slot)
        return cached, slots, missing

    def insert(self, rows: list[int], data: torch.Tensor) -> None:
        """Keep `rows` (not cached; `data` [len(rows), row size] uint8 on the buffer's device), evicting the least
        recently used: of a lookup larger than the cache (a prefill), the last rows."""
        keep = rows[-self.capacity:] if self.capacity else []
        data = data[len(rows) - len(keep):]
        slots = []
        for row in keep:
            if len(self._where) < self.capacity:
                slot = len(self._where)
            else:
                _, slot = self._where.popitem(last=False)
            self._where[row] = slot
            slots.append(slot)
        if slots:
            self.buffer[torch.tensor(slots, device=self.buffer.device)] = data


def row_caches(checkpoint: ModelCheckpoint, placement: Placement, compute: Tier,
               ledger: Ledger) -> dict[UnitKey, RowCache]:
    """A RowCache per unit read by rows, sharing the compute tier's row cache bytes (charged here)."""
    nbytes = placement.compute.row_cache_bytes
    keys = [k for k in checkpoint.layouts if placement.by_rows(k.kind)]
    if not nbytes or not keys:
        return {}
    ledger.charge(compute.name, nbytes, "row cache")
    caches = {}
    for key in keys:
        size = row_bytes(row_tensor(checkpoint.layouts[key]))
        caches[key] = RowCache(nbytes // len(keys) // size, size, compute.device)
    return caches


class RowReader:
    """The store's `rows`: a lookup's rows from the host tier's pinned copy, the row cache, or the checkpoint
    (read by the reader pool through the store's UnitIO). `wait` waits for some of the reads like a demand miss
    (TieredStore._wait_any: counted as I/O wait, an IOStallError once no read makes progress)."""

    def __init__(self, checkpoint: ModelCheckpoint, placement: Placement, compute: Tier, host: Tier | None,
                 dtype: torch.dtype, caches: dict[UnitKey, RowCache], io: UnitIO, pool: ReaderPool,
                 wait: Callable[[dict[Future, UnitKey]], set[Future]], lock: threading.RLock, stats: StoreStats):
        self.layouts, self.placement, self.compute, self.host, self.dtype = (checkpoint.layouts, placement, compute,
                                                                            host, dtype)
        self.caches, self.io, self.pool, self.wait, self.lock, self.stats = caches, io, pool, wait, lock, stats

    def rows(self, key: UnitKey, ids: torch.Tensor) -> tuple[Weights, torch.Tensor] | None:
        """See TieredStore.rows."""
        layout = self.layouts[key]
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
        cache = self.caches.get(key)
        cached, slots, missing = cache.lookup(rows) if cache is not None else ([], [], list(range(len(rows))))
        ids = [rows[i] for i in missing]
        with self.lock:
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
        inflight = {self.pool.submit(DEMAND, partial(self.io.read_ranges, group, blob), f"{key} rows"): key
                    for group in split(ranges, self.pool.threads)}
        try:
            while inflight:
                for fut in self.wait(inflight):
                    del inflight[fut]
                    if fut.cancelled():
                        raise EngineClosedError(f"the weight store was closed while {key}'s rows were queued")
                    if fut.exception() is not None:
                        raise fut.exception()
        finally:
            for fut in inflight:  # a failed request starts no more reads; running ones fill a buffer now unused
                fut.cancel()
        self.io.counters.add(read=sum(r.nbytes for r in ranges))
