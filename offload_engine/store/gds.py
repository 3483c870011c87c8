"""GPUDirect Storage reads through kvikio: NVMe -> device memory without a host bounce.

Optional (`pip install .[gds]`) and detected at run time: kvikio imports on machines without a GPU, but every
read needs libcuda, so it is only tried when the store's compute tier is a CUDA device. Any failure to set it up
(no kvikio, no libcuda, no cuFile driver: kvikio then falls back to its own POSIX compat mode) leaves the store
on its host-bounce path.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from ..checkpoint.layout import ReadRange
from ..errors import IOFault
from .disk import ShardFiles


class GdsReader:
    def __init__(self, kvikio_module, files: ShardFiles):
        self._kvikio = kvikio_module
        self._files = files
        self._handles: dict[Path, object] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, files: ShardFiles) -> "GdsReader | None":
        try:
            import kvikio  # noqa: PLC0415  (optional extra)
        except Exception:  # ImportError, or a broken CUDA runtime raising at import
            return None
        return cls(kvikio, files)

    def _handle(self, path: Path):
        with self._lock:
            h = self._handles.get(path)
            if h is None:
                self._files.fd(path)  # identity check against the index first
                h = self._handles[path] = self._kvikio.CuFile(str(path), "r")
            return h

    def read(self, r: ReadRange, blob: torch.Tensor) -> None:
        dst = blob[r.blob_offset:r.blob_offset + r.nbytes]
        try:
            n = self._handle(r.file).pread(dst, r.nbytes, r.file_offset).get()
        except Exception as e:  # kvikio raises RuntimeError with the cuFile status
            self._files.recheck(r.file)
            raise IOFault(r.file, r.file_offset, None, f"GPUDirect read failed: {e}") from None
        if n != r.nbytes:
            self._files.recheck(r.file)
            raise IOFault(r.file, r.file_offset + n, None, f"short GPUDirect read: {n} of {r.nbytes} bytes")

    def close(self) -> None:
        with self._lock:
            for h in self._handles.values():
                h.close()
            self._handles.clear()
