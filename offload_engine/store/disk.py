"""Reading a unit's byte ranges from the checkpoint files into a blob, with located errors.

Reads go through os.preadv into the destination buffer (no intermediate copy; the GIL is released during the
syscall). Every failure is an IOFault naming the shard and the offset; a shard whose identity (device, inode,
size, mtime) changed since the index was built is reported as changed on disk rather than read.
"""
from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import torch

from ..checkpoint.index import ShardInfo
from ..checkpoint.layout import ReadRange, UnitLayout
from ..errors import IOFault


class ShardFiles:
    """Open file descriptors of the shards, checked against the identity recorded by the index."""

    def __init__(self, shards: list[ShardInfo]):
        self._info = {s.path: s for s in shards}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise IOFault(path, 0, e.errno, f"cannot open shard: {e.strerror}") from None
                self._check_identity(path, fd)
                self._fds[path] = fd
            return fd

    def _check_identity(self, path: Path, fd: int) -> None:
        st = os.fstat(fd)
        info = self._info.get(path)
        if info is not None and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != info.identity:
            raise IOFault(path, 0, None, "shard changed on disk since it was indexed; re-open the model")

    def recheck(self, path: Path) -> None:
        """After a failed read: say so if the file changed under us (replaced, truncated, rewritten)."""
        try:
            st = os.stat(path)
        except OSError:
            raise IOFault(path, 0, errno.ENOENT, "shard disappeared from disk") from None
        info = self._info.get(path)
        if info is not None and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != info.identity:
            raise IOFault(path, 0, None, "shard changed on disk since it was indexed; re-open the model")

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_range(files: ShardFiles, r: ReadRange, blob: torch.Tensor) -> None:
    """Fill blob[r.blob_offset : +r.nbytes] from r.file at r.file_offset, looping over short reads."""
    view = memoryview(blob.numpy()).cast("B")[r.blob_offset:r.blob_offset + r.nbytes]
    fd, done = files.fd(r.file), 0
    while done < r.nbytes:
        try:
            n = os.preadv(fd, [view[done:]], r.file_offset + done)
        except OSError as e:
            files.recheck(r.file)
            raise IOFault(r.file, r.file_offset + done, e.errno, e.strerror or str(e)) from None
        if n == 0:
            files.recheck(r.file)
            raise IOFault(r.file, r.file_offset + done, None,
                          f"unexpected end of file: wanted {r.nbytes - done} more bytes")
        done += n


def read_unit(files: ShardFiles, layout: UnitLayout, blob: torch.Tensor) -> None:
    for r in layout.read_ranges():
        read_range(files, r, blob)


# ---- direct I/O -------------------------------------------------------------------------------------------
ALIGN = 4096
BOUNCE_BYTES = 1024 * 1024  # per reader thread, page aligned, charged to the host tier as staging


def open_direct(path: Path) -> int | None:
    """An O_DIRECT descriptor, or None where the filesystem refuses it (tmpfs, some overlays)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


def read_range_direct(fd: int, r: ReadRange, blob: torch.Tensor, bounce: memoryview) -> None:
    """O_DIRECT: aligned over-reads into a page-aligned bounce buffer, then the wanted bytes into the blob.
    The page cache is bypassed, so the process's real memory stays within the budget."""
    dst = memoryview(blob.numpy()).cast("B")
    pos, end = r.file_offset, r.file_offset + r.nbytes
    while pos < end:
        start = pos - pos % ALIGN
        want = min(len(bounce), -(-(end - start) // ALIGN) * ALIGN)
        try:
            n = os.preadv(fd, [bounce[:want]], start)
        except OSError as e:
            raise IOFault(r.file, start, e.errno, e.strerror or str(e)) from None
        got = min(start + n, end) - pos
        if got <= 0:
            raise IOFault(r.file, pos, None, f"unexpected end of file: wanted {end - pos} more bytes")
        at = r.blob_offset + (pos - r.file_offset)
        dst[at:at + got] = bounce[pos - start:pos - start + got]
        pos += got


def drop_cache(fd: int, offset: int, nbytes: int) -> None:
    """Buffered reads when O_DIRECT is unavailable: tell the kernel we will not reread these pages."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
