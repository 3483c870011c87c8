"""Streaming safetensors I/O for the quantizer: rows read from the source shards with pread, results written with
pwrite into output shards whose headers are laid out before any data (every stored tensor's dtype and shape is
known from the plan), so nothing larger than one chunk of rows is ever in memory. And the staging folder: the
output is written into a temporary folder beside --out and renamed onto it only when complete.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable

import torch

from ..checkpoint.index import TensorRecord
from ..errors import CheckpointError, ConfigError
from .scheme import SAFETENSORS_DTYPES

COPY_CHUNK = 64 << 20  # bytes per read/write when a tensor is copied as stored


class ShardWriter:
    """One safetensors file: header written at open (tensors in the given order, 8-byte aligned header), then
    each tensor's bytes at their place, in any order and in pieces. finish() checks every byte was written
    and syncs; close() only closes (a run cut short closes without checking)."""

    def __init__(self, path: Path, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path = path
        header: dict = {"__metadata__": {"format": "pt"}}
        self.spans: dict[str, tuple[int, int]] = {}
        self.shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        pos = 0
        for name, dtype, shape in entries:
            n = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.spans[name] = (pos, pos + n)
            self.shapes[name] = (dtype, tuple(shape))
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.written = dict.fromkeys(self.spans, 0)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.pwrite(self.fd, len(raw).to_bytes(8, "little") + raw, 0)
        os.ftruncate(self.fd, self.data_start + pos)

    def write(self, name: str, t: torch.Tensor, at: int = 0) -> None:
        """Bytes of `t` (its dtype must be the entry's) at byte `at` of tensor `name`'s data."""
        dtype, _ = self.shapes[name]
        if t.dtype != dtype:
            raise AssertionError(f"{self.path.name}: {name} planned as {dtype}, computed as {t.dtype}")
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        begin, end = self.spans[name]
        if begin + at + data.nbytes > end:
            raise AssertionError(f"{self.path.name}: {name} written past its end")
        _pwrite_all(self.fd, memoryview(data), self.data_start + begin + at)
        self.written[name] += data.nbytes

    def write_bytes(self, name: str, data: bytes, at: int) -> None:
        begin, _ = self.spans[name]
        _pwrite_all(self.fd, memoryview(data), self.data_start + begin + at)
        self.written[name] += len(data)

    def finish(self) -> None:
        """Every tensor complete, on disk."""
        short = [n for n, (b, e) in self.spans.items() if self.written[n] != e - b]
        if short:
            raise AssertionError(f"{self.path.name}: tensors not fully written: {short[:4]}")
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class SourceReader:
    """Rows of source tensors, read with pread (one descriptor per shard, closed by close())."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def _fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def read(self, rec: TensorRecord, start: int, n: int) -> bytes:
        data = os.pread(self._fd(rec.file), n, rec.offset + start)
        if len(data) != n:
            raise CheckpointError(rec.file, f"short read: {len(data)} of {n} bytes at {rec.offset + start} (the "
                                            f"file changed while being quantized?)", tensor=rec.name)
        return data

    def rows(self, rec: TensorRecord, first: int, count: int) -> torch.Tensor:
        """Rows first..first+count of `rec` seen as [rows, in] (fused [E, out, in] tensors: E * out rows), read
        straight into the tensor's buffer."""
        inp = rec.shape[-1]
        n = count * inp * rec.torch_dtype.itemsize
        buf = bytearray(n)
        got, view = 0, memoryview(buf)
        while got < n:
            k = os.preadv(self._fd(rec.file), [view[got:]], rec.offset + first * inp * rec.torch_dtype.itemsize + got)
            if k == 0:
                raise CheckpointError(rec.file, f"short read: {got} of {n} bytes (the file changed while being "
                                                f"quantized?)", tensor=rec.name)
            got += k
        return torch.frombuffer(buf, dtype=rec.torch_dtype).view(count, inp)

    def copy(self, rec: TensorRecord, out: ShardWriter, chunk: int = COPY_CHUNK) -> None:
        """`rec` as stored, `chunk` bytes at a time."""
        for at in range(0, rec.nbytes, chunk):
            out.write_bytes(rec.name, self.read(rec, at, min(chunk, rec.nbytes - at)), at)

    def close(self) -> None:
        while self.fds:
            _, fd = self.fds.popitem()
            os.close(fd)


class Staging:
    """A temporary folder beside `out`, renamed onto `out` by publish(), removed by discard() with the parent
    folders create() had to make. The caller runs discard() in a `finally` (through finish_despite_interrupts):
    each folder is recorded before it is made, so a Ctrl-C landing anywhere from create() on leaves nothing."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp: Path | None = None
        self.made: list[Path] = []  # parent folders this run created (removed again unless published)

    def create(self) -> Path:
        missing = [p for p in self.out.absolute().parents if not p.exists()]
        for parent in reversed(missing):
            self.made.insert(0, parent)
            os.mkdir(parent)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.mkdir(self.tmp)
        return self.tmp

    def publish(self) -> None:
        assert self.tmp is not None
        if self.out.exists() or self.out.is_symlink():
            raise ConfigError(f"--out {self.out}: appeared while quantizing; not overwritten")
        os.rename(self.tmp, self.out)
        self.tmp, self.made = None, []

    def discard(self) -> None:
        """Idempotent: removes what is left of the temporary folder and the parents made for it."""
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if not self.tmp.exists():
                self.tmp = None
        while self.made and self.tmp is None:  # deepest first; one someone else filled meanwhile stays
            try:
                self.made[0].rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                self.made = []
                break
            self.made.pop(0)
