"""How much of a set of files the page cache holds: for the budget tests (tests/os_memory.py) and the real-size
bench (tools/bench_size.py), which count a run's cached checkpoint pages beside its RSS."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore's byte per page: bit 0 is residency, the rest undefined


def cached_bytes(paths: list[Path]) -> int:
    """Bytes of these files the page cache holds now (mincore over a read-only shared mapping: mapping a file
    reads nothing, and mincore faults nothing in)."""
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if not size:
                continue
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                total += vec.raw.translate(_LOW_BIT).count(1) * mmap.PAGESIZE
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total
