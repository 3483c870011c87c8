"""Reading a unit's byte ranges from the checkpoint files into a blob, with located errors.

Reads go through os.preadv into the destination buffer (no intermediate copy; the GIL is released during the
syscall). Every failure is an IOFault naming the shard and the offset. A shard whose identity (device, inode,
size, mtime) differs from the one recorded by the index is reported as changed on disk rather than read, and
the identity is re-checked after every read, so a shard replaced (os.replace), truncated or rewritten after the
engine opened it fails every read of it with "shard changed on disk" until the model is re-opened (or the
original file is put back), instead of serving bytes the index never validated.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.index import ShardInfo
from ..checkpoint.layout import ReadRange, UnitLayout
from ..constants import PAGE
from ..errors import IOFault
from .readers import reading

# bytes per read call: progress the stall watchdog sees at least every ~2-40 ms (NVMe to a slow SATA disk), and
# few, large requests (the bench model's 3 MiB expert in one call: 2.45 ms on this VM's disk; in 1 MiB calls: 2.76)
READ_CHUNK = 4 << 20
DROP_GRAIN = max(2 << 20, mmap.PAGESIZE)  # the largest page-cache folio on x86-64 (PMD size)


class ShardFiles:
    """Open file descriptors of the shards, checked against the identity recorded by the index."""

    def __init__(self, shards: list[ShardInfo]):
        self._info = {s.path: s for s in shards}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._closed = [False]  # shared with the finalizer
        # dropped without close(): the descriptors are closed when the object is collected
        self._finalizer = weakref.finalize(self, _close_fds, self._fds, self._lock, self._closed)

    def fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                if self._closed[0]:  # a reader that outlived close() must not open (and leak) a descriptor
                    raise IOFault(path, 0, None, "shard files are closed (the engine was closed)")
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise IOFault(path, 0, e.errno, f"cannot open shard: {e.strerror}") from None
                try:
                    self.check_fd(path, fd)
                except BaseException:
                    os.close(fd)
                    raise
                self._fds[path] = fd
            return fd

    def check_fd(self, path: Path, fd: int, offset: int = 0) -> None:
        """A freshly opened descriptor must be the very file the index validated."""
        self._raise_if_changed(path, offset, os.fstat(fd), None)

    def verify(self, path: Path, fd: int, offset: int) -> None:
        """After a read through `fd`: the open file was not modified or resized, and the path still names it.
        Two stat calls per read range (microseconds next to the read itself)."""
        try:
            st_path = os.stat(path)
        except OSError:
            raise IOFault(path, offset, errno.ENOENT, "shard disappeared from disk (deleted or renamed) since it "
                          "was indexed; re-open the model") from None
        self._raise_if_changed(path, offset, os.fstat(fd), st_path)

    def recheck(self, path: Path, offset: int = 0) -> None:
        """After a failed read: say so if the file changed under us (replaced, truncated, rewritten)."""
        try:
            st = os.stat(path)
        except OSError:
            raise IOFault(path, offset, errno.ENOENT, "shard disappeared from disk (deleted or renamed) since it "
                          "was indexed; re-open the model") from None
        self._raise_if_changed(path, offset, st, st)

    def _raise_if_changed(self, path: Path, offset: int, st_open: os.stat_result,
                          st_path: os.stat_result | None) -> None:
        info = self._info.get(path)
        if info is None:
            return
        dev, ino, size, mtime = info.identity
        why = []
        for st in (st_path, st_open):
            if st is not None and (st.st_dev, st.st_ino) != (dev, ino):
                why.append(f"replaced (inode {ino} -> {st.st_ino})")
                break
        if st_open.st_size != size:
            why.append(f"size {size} -> {st_open.st_size} bytes")
        elif st_open.st_mtime_ns != mtime:
            why.append("modified (mtime changed)")
        if why:
            raise IOFault(path, offset, None, f"shard changed on disk since it was indexed: {', '.join(why)}; "
                          f"re-open the model")

    @property
    def closed(self) -> bool:
        return self._closed[0]

    def close(self) -> None:
        """Idempotent. Reads after close fail (IOFault) rather than reopen the shards."""
        self._finalizer.detach()  # called directly: a rerun after an interrupt must still close what is left
        _close_fds(self._fds, self._lock, self._closed)


def _close_fds(fds: dict[Path, int], lock: threading.Lock, closed: list[bool]) -> None:
    with lock:
        closed[0] = True
        while fds:  # popped first: never closed twice
            _, fd = fds.popitem()
            try:
                os.close(fd)
            except OSError:
                pass


def read_range(files: ShardFiles, r: ReadRange, blob: torch.Tensor) -> None:
    """Fill blob[r.blob_offset : +r.nbytes] from r.file at r.file_offset, looping over short reads. At most
    READ_CHUNK bytes per system call, so the stall watchdog sees a slow disk make progress."""
    view = memoryview(blob.numpy()).cast("B")[r.blob_offset:r.blob_offset + r.nbytes]
    fd, done = files.fd(r.file), 0
    while done < r.nbytes:
        pos = r.file_offset + done
        want = min(READ_CHUNK, r.nbytes - done)
        try:
            with reading(r.file, pos, want):
                n = os.preadv(fd, [view[done:done + want]], pos)
        except OSError as e:
            files.recheck(r.file, pos)
            raise IOFault(r.file, pos, e.errno, e.strerror or str(e)) from None
        if n == 0:
            files.recheck(r.file, pos)
            raise IOFault(r.file, pos, None, f"unexpected end of file: wanted {r.nbytes - done} more bytes")
        done += n
    files.verify(r.file, fd, r.file_offset)


def read_unit(files: ShardFiles, layout: UnitLayout, blob: torch.Tensor) -> None:
    for r in layout.read_ranges():
        read_range(files, r, blob)


# ---- direct I/O -------------------------------------------------------------------------------------------
ALIGN = PAGE  # the name tests/test_store.py and tests/test_io_faults.py import; this module says PAGE


def open_direct(path: Path, files: ShardFiles | None = None) -> int | None:
    """An O_DIRECT descriptor, or None where the filesystem refuses it (tmpfs, some overlays). With `files`, the
    descriptor is checked against the identity the index recorded (IOFault when the shard changed)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    if files is not None:
        try:
            if files.closed:
                raise IOFault(path, 0, None, "shard files are closed (the engine was closed)")
            files.check_fd(path, fd)
        except BaseException:
            os.close(fd)
            raise
    return fd


def read_range_direct(fd: int, r: ReadRange, blob: torch.Tensor, bounce: memoryview,
                      files: ShardFiles | None = None) -> None:
    """O_DIRECT: aligned over-reads into a page-aligned bounce buffer, then the wanted bytes into the blob.
    The page cache is bypassed, so the process's real memory stays within the budget. With `files`, failures and
    finished reads are checked against the shard's recorded identity, as in read_range. For a unit that is one
    range and whose slot has DIRECT_SLACK, read_unit_direct skips the bounce (and its copy)."""
    # torch copies (not memoryview slices): they release the GIL, so the compute thread keeps running while a
    # reader moves the bounce buffer into the slot
    src = torch.frombuffer(bounce, dtype=torch.uint8)
    pos, end = r.file_offset, r.file_offset + r.nbytes
    while pos < end:
        start = pos - pos % PAGE
        got = _pread_aligned(fd, r, start, min(end, start + len(bounce)), bounce, files) - (pos - start)
        at = r.blob_offset + (pos - r.file_offset)
        blob[at:at + got].copy_(src[pos - start:pos - start + got])
        pos += got
    _verify_after(fd, r, files)


@dataclass(frozen=True)
class DirectAlign:
    """What O_DIRECT on a file asks of a read: the memory address aligned to `memory` bytes, the file offset and
    the length to `offset` bytes (statx STATX_DIOALIGN, Linux >= 6.1; ext4 and xfs report the disk's DMA alignment
    and logical block: 4 and 512 bytes on NVMe, 512 and 512 on this VM's virtio disk)."""
    memory: int
    offset: int


PAGE_DIRECT = DirectAlign(PAGE, PAGE)  # where the system does not say: a page, which every filesystem accepts
STATX_DIOALIGN, AT_EMPTY_PATH = 0x2000, 0x1000
_STATX_SIZE, _STATX_DIO_MEM_ALIGN = 256, 152  # struct statx: its size, and where stx_dio_mem_align (u32) is


def direct_alignment(fd: int) -> DirectAlign:
    """The O_DIRECT alignment the file of `fd` reports; PAGE_DIRECT where it reports none (an older kernel or C
    library, a filesystem that does not say, not Linux) or something larger than a page."""
    try:
        statx = ctypes.CDLL(None, use_errno=True).statx
    except (AttributeError, OSError):
        return PAGE_DIRECT
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(fd, b"", AT_EMPTY_PATH, STATX_DIOALIGN, buf) != 0:
        return PAGE_DIRECT
    mask = int.from_bytes(buf.raw[0:4], sys.byteorder)
    memory, offset = (int.from_bytes(buf.raw[at:at + 4], sys.byteorder)
                      for at in (_STATX_DIO_MEM_ALIGN, _STATX_DIO_MEM_ALIGN + 4))
    if not mask & STATX_DIOALIGN or not all(0 < a <= PAGE and a & (a - 1) == 0 for a in (memory, offset)):
        return PAGE_DIRECT
    return DirectAlign(memory, offset)


# A slot read straight from O_DIRECT needs room (constants.DIRECT_SLACK) for up to PAGE - 1 bytes to reach a page
# boundary in the slot, up to PAGE - 1 bytes of file before the unit (its offset within an aligned block) and the
# tail of the last block.


def read_unit_direct(fd: int, layout: UnitLayout, blob: torch.Tensor, files: ShardFiles | None = None,
                     align: DirectAlign = PAGE_DIRECT) -> int | None:
    """O_DIRECT straight into the slot, no bounce buffer: the unit's one range is read with its aligned
    surroundings so that the unit begins at a page boundary of `blob`. Returns where the unit's bytes begin in
    `blob` (the slot's offset for its views), or None when this unit cannot be read so (several ranges, a slot
    without DIRECT_SLACK, or tensors whose file offsets would leave a typed view misaligned): use
    read_range_direct.

    Why a page boundary: at its offset in the file's page, every 4 KiB row of a weight matrix straddles two
    pages, and the CPU's stream prefetchers, which stop at page boundaries, restart mid-row: the bench model's
    expert (3 x 1 MiB fp32, 1024-float rows) took 266-271 us per decode call at page offsets 0x760-0xf00 against
    249-251 us page-aligned. Where the file's DMA alignment allows (`align.memory` divides the unit's offset in
    its aligned block: NVMe's 4 bytes always do), the read lands it there; otherwise (this VM's 512 bytes) it is
    read to an aligned address and moved down on the reader thread (~0.17 ms per 3 MiB; ctypes.memmove releases
    the GIL), once per read, where the misaligned views would cost on every use."""
    r = layout.single_range
    if r is None:
        return None
    lead = r.file_offset % align.offset  # bytes of file read before the unit
    grain = max(align.offset, align.memory)  # lengths: the file's block, and every chunk's start stays aligned
    length = -(-(lead + r.nbytes) // grain) * grain
    base = blob.data_ptr()
    lands = lead % align.memory == 0
    # reading to `dest`, the unit begins at `at`, a page boundary (moved there when the read cannot land it so)
    at = -(base + lead) % PAGE + lead if lands else -base % PAGE
    dest = at - lead if lands else at
    if dest + length > blob.numel():
        return None
    _pread_aligned(fd, r, r.file_offset - lead, r.file_offset + r.nbytes,
                   memoryview(blob.numpy()).cast("B")[dest:dest + length], files, grain)
    _verify_after(fd, r, files)
    if not lands and lead:  # overlapping, to a lower address: memmove's case
        ctypes.memmove(base + at, base + at + lead, r.nbytes)
    return at


def _pread_aligned(fd: int, r: ReadRange, start: int, need_end: int, buf: memoryview,
                   files: ShardFiles | None, grain: int = PAGE) -> int:
    """Aligned O_DIRECT reads of the file from `start` (a multiple of `grain`) into `buf` (aligned as the file
    asks), READ_CHUNK bytes per call so the stall watchdog sees progress, until the bytes up to `need_end` are in.
    Returns how many bytes from `start` are valid (at least need_end - start). Short reads re-read from the last
    whole grain."""
    end = r.file_offset + r.nbytes
    done, stuck = 0, 0
    while start + done < need_end:
        want = min(READ_CHUNK, -(-(need_end - start - done) // grain) * grain, len(buf) - done)
        pos = start + done
        try:
            with reading(r.file, pos, want):
                n = os.preadv(fd, [buf[done:done + want]], pos)
        except OSError as e:
            if files is not None:
                files.recheck(r.file, pos)
            raise IOFault(r.file, pos, e.errno, e.strerror or str(e)) from None
        if n == 0:
            at = max(pos, r.file_offset)
            if files is not None:
                files.recheck(r.file, at)
            _raise_if_shorter(fd, r, at)
            raise IOFault(r.file, at, None, f"unexpected end of file: wanted {end - at} more bytes")
        if n < want and pos + n < need_end:  # short read inside the range: continue from the last whole grain
            whole = n - n % grain
            if whole == 0:
                stuck += 1
                if stuck > 8:
                    raise IOFault(r.file, pos, None, f"short reads make no progress ({n} bytes from offset {pos})")
                continue
            n = whole
        stuck = 0
        done += n
    return min(done, need_end - start)


def _verify_after(fd: int, r: ReadRange, files: ShardFiles | None) -> None:
    if files is not None:
        files.verify(r.file, fd, r.file_offset)
        return
    # no recorded identity to compare with: at least notice a path that no longer names this file
    st = os.fstat(fd)
    try:
        same = os.path.samestat(st, os.stat(r.file))
    except OSError:
        same = False
    if not same:
        raise IOFault(r.file, r.file_offset, None, "shard changed on disk since it was opened: replaced or "
                      "deleted; re-open the model")


def _raise_if_shorter(fd: int, r: ReadRange, pos: int) -> None:
    """End of file inside a range the index validated: the shard shrank after it was indexed."""
    size = os.fstat(fd).st_size
    if size < r.file_offset + r.nbytes:
        raise IOFault(r.file, pos, None, f"shard changed on disk since it was indexed: size now {size} bytes, but "
                      f"this tensor data ends at byte {r.file_offset + r.nbytes} (truncated?); re-open the model")


def drop_cache(fd: int, offset: int, nbytes: int) -> None:
    """Buffered reads when O_DIRECT is unavailable: tell the kernel we will not reread these pages. The range is
    widened to DROP_GRAIN: the kernel drops only the page-cache folios (up to 2 MiB: ext4, xfs) that lie wholly
    inside it, and a folio across the boundary of two units would stay cached after both were read and dropped
    (measured: 6-37 MB of a 109 MB model left cached after its load, in 64 KiB to MiB pieces). A neighbour's
    pages dropped early are read again if needed; folios in use by a read are skipped by the kernel."""
    if hasattr(os, "posix_fadvise"):
        start, end = offset - offset % DROP_GRAIN, -(-(offset + nbytes) // DROP_GRAIN) * DROP_GRAIN
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
