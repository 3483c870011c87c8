"""UnitIO: the store's I/O, and nothing else: a unit's bytes from disk into a slot (buffered, O_DIRECT or
GPUDirect) and from a host slot into a compute-tier slot. Which slot and which tier is the store's business
(fill.py); this object only moves bytes, counts them and owns the descriptors, streams and buffers that takes.

The store takes one in its constructor (default: built from the store's own arguments), so fault tests hand it
a faulty one: `read_fn` replaces the disk read of one byte range, `copy_fn` the host -> compute copy of one unit,
or a subclass overrides `read` / `copy` outright.
"""
from __future__ import annotations

import mmap
import os
import threading
from dataclasses import replace
from typing import Callable, Iterable, Sequence

import torch

from ..checkpoint.layout import ReadRange, UnitLayout
from ..constants import BOUNCE_BYTES
from .disk import (PAGE_DIRECT, DirectAlign, ShardFiles, direct_alignment, drop_cache, open_direct,
                   read_range, read_range_direct, read_unit_direct)
from .gds import GdsReader
from .readers import reading
from .stats import IOCounters
from .tier import Slot

DROP_CHUNK = BOUNCE_BYTES  # buffered reads whose pages are dropped: as O_DIRECT's bounce reads, 1 MiB
ReadFn = Callable[[ShardFiles, ReadRange, torch.Tensor], None]  # (files, range, destination blob)
CopyFn = Callable[[torch.Tensor, torch.Tensor], None]  # (destination, source): same size, same dtype


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The default host -> compute copy: asynchronous into a GPU (from pinned memory; UnitIO.copy waits for it)."""
    dst.copy_(src, non_blocking=dst.device.type == "cuda")


class UnitIO:
    def __init__(self, shards: Sequence[os.PathLike | str], device: torch.device, *, direct_io: bool = False,
                 bounce_bytes: int = BOUNCE_BYTES, gds: bool = True, read_fn: ReadFn | None = None,
                 copy_fn: CopyFn | None = None, keep_cache: bool = True):
        """keep_cache=False: buffered reads drop the pages they read from the page cache (a RAM budget the
        weights fit: the slot holds the bytes, and a cached copy would take as much again outside the budget)."""
        self.files = ShardFiles(shards)
        self.direct_io, self.keep_cache = direct_io, keep_cache
        self.counters = IOCounters()
        self._read_fn = read_fn or read_range
        self._copy_fn = copy_fn or copy_bytes
        self._bounce_bytes = bounce_bytes if direct_io else 0
        self._local = threading.local()  # each reader thread's bounce buffer
        self._lock = threading.Lock()
        self._direct_fds: dict = {}
        self._advised: dict = {}  # path -> the buffered descriptor advised POSIX_FADV_RANDOM
        self._direct_aligns: dict[os.PathLike, DirectAlign] = {}  # what O_DIRECT asks of each file opened so far
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        # a read_fn defines the disk read (fault injection): GPUDirect would go around it
        self.gds = GdsReader.open(self.files) if cuda and gds and read_fn is None else None

    # ---- disk -> slot ---------------------------------------------------------------------------------
    def read(self, layout: UnitLayout, slot: Slot) -> None:
        """The unit's bytes from disk into a host-memory slot: O_DIRECT straight into it where the unit allows
        (its bytes then start page-shifted: slot.offset), else range by range."""
        slot.offset = self._read_unit_direct(layout, slot.blob) if self.direct_io else None
        if slot.offset is None:
            slot.offset = 0
            self.read_ranges(layout.read_ranges(), slot.blob)
        self.counters.add(read=layout.nbytes)

    def read_gds(self, layout: UnitLayout, slot: Slot) -> None:
        """GPUDirect: NVMe straight into a device slot."""
        slot.offset = 0
        for r in layout.read_ranges():
            with reading(r.file, r.file_offset, r.nbytes):
                self.gds.read(r, slot.blob)
        self.counters.add(read=layout.nbytes)

    def read_ranges(self, ranges: Iterable[ReadRange], blob: torch.Tensor) -> None:
        """Byte ranges into `blob` at their blob offsets (not counted: the caller counts what it needed)."""
        for r in ranges:
            # the range is recorded around the whole read function too, so a read_fn that blocks before it
            # reaches the disk is still reported by file and offset (the disk readers record finer ranges)
            with reading(r.file, r.file_offset, r.nbytes):
                self._read_range(r, blob)

    def _read_unit_direct(self, layout: UnitLayout, blob: torch.Tensor) -> int | None:
        """O_DIRECT straight into the slot (no bounce copy) when the unit allows it: the offset of its bytes."""
        r = layout.single_range
        fd = self._direct_fd(r.file) if r is not None else None
        return None if fd is None else read_unit_direct(fd, layout, blob, self.files, self._direct_aligns[r.file])

    def _read_range(self, r: ReadRange, blob: torch.Tensor) -> None:
        if self.direct_io:
            fd = self._direct_fd(r.file)
            if fd is not None:
                read_range_direct(fd, r, blob, self._bounce(), self.files)
                return
        if self.keep_cache and not self.direct_io:
            self._read_fn(self.files, r, blob)
            return
        # O_DIRECT refused by the filesystem, or a budget: the pages read leave the page cache, DROP_CHUNK at a
        # time, so each reader thread holds at most that much there (a dense unit can be a GB)
        self._no_readahead(r.file)
        for at in range(0, r.nbytes, DROP_CHUNK):
            part = replace(r, file_offset=r.file_offset + at, nbytes=min(DROP_CHUNK, r.nbytes - at),
                           blob_offset=r.blob_offset + at)
            self._read_fn(self.files, part, blob)
            drop_cache(self.files.fd(r.file), part.file_offset, part.nbytes)

    def _no_readahead(self, path) -> None:
        """Reads whose pages are dropped read no further than asked (POSIX_FADV_RANDOM on the descriptor): the
        kernel's readahead (up to read_ahead_kb past each read, 8 MiB on this project's VM) would cache pages past
        each range that nothing drops."""
        fd = self.files.fd(path)
        with self._lock:  # advised before any thread reads through it
            if self._advised.get(path) != fd and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                self._advised[path] = fd

    def _direct_fd(self, path):
        """Cached O_DIRECT descriptor (None: refused by the filesystem); checked against the index's identity."""
        with self._lock:
            if path not in self._direct_fds:
                fd = self._direct_fds[path] = open_direct(path, self.files)
                self._direct_aligns[path] = direct_alignment(fd) if fd is not None else PAGE_DIRECT
            return self._direct_fds[path]

    def _bounce(self) -> memoryview:
        """This reader thread's page-aligned bounce buffer for O_DIRECT (anonymous mmap: aligned by construction)."""
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            buf = self._local.bounce = memoryview(mmap.mmap(-1, self._bounce_bytes))
        return buf

    # ---- host slot -> compute slot ----------------------------------------------------------------------
    def copy(self, src: Slot, dst: Slot, nbytes: int) -> None:
        """A unit's `nbytes` from a host slot into a compute-tier slot. On CUDA: an async copy from pinned memory
        on the copy stream; the reader thread waits on its event, so the compute stream never blocks on transfers
        it does not need."""
        dst.offset = 0
        source = src.blob[src.offset:src.offset + nbytes]
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                self._copy_fn(dst.blob[:nbytes], source)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            done.synchronize()
        else:
            self._copy_fn(dst.blob[:nbytes], source)
        self.counters.add(copied=nbytes)

    def close(self) -> None:
        self.files.close()
        if self.gds is not None:
            self.gds.close()
        while self._direct_fds:  # popped first: a rerun after an interrupt never closes a descriptor twice
            _, fd = self._direct_fds.popitem()
            if fd is not None:
                os.close(fd)
