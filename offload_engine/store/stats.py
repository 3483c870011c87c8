"""The store's counters: what it served from where, what it read and copied, and how long callers waited."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .readers import BusyClock


class IOCounters:
    """Bytes moved by a UnitIO: read from disk and copied host -> compute tier. Its own lock: reader threads
    count while the store's lock may be held by the compute thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.read = 0
        self.copied = 0

    def add(self, read: int = 0, copied: int = 0) -> None:
        with self._lock:
            self.read += read
            self.copied += copied


@dataclass
class StoreStats:
    hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    misses: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
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
    io: IOCounters = field(default_factory=IOCounters, repr=False)  # the store's UnitIO's byte counts

    @property
    def bytes_read_disk(self) -> int:
        return self.io.read

    @property
    def bytes_host_to_device(self) -> int:
        return self.io.copied

    def snapshot(self) -> dict:
        return {"hits": dict(self.hits), "misses": dict(self.misses), "bytes_read_disk": self.bytes_read_disk,
                "bytes_host_to_device": self.bytes_host_to_device, "io_wait_s": self.io_wait_s,
                "prefetch_issued": self.prefetch_issued, "prefetch_used": self.prefetch_used,
                "prefetch_wasted": self.prefetch_wasted, "prefetch_cancelled": self.prefetch_cancelled,
                "prefetch_failed": self.prefetch_failed, "rows": dict(self.rows),
                "expert_reads": dict(self.expert_reads), "host_computed": self.host_computed,
                "read_busy_s": self.read_busy.seconds()}
