"""A GGUF header read and checked in one walk: the metadata's values and every tensor's info.

The layout is gguf.md's (magic, version, tensor and key counts, key/value pairs, tensor infos), read through a
read-only memory map; every length and count is checked against the bytes left in the file, every tensor's
dimension count and type, before anything is allocated; the error names the file, and the key or tensor where one
is at fault. The `gguf` package's own reader (llama.cpp's) trusts the counts it reads (an array of 2**60 items
loops 2**60 times, a string longer than the file is cut short) and builds a numpy view per item: ~13 s for a
Qwen3 header's 151k-token vocabulary and merges, read twice at open (the model, the tokenizer), where this walk
takes ~0.4 s. tests/test_gguf.py checks its values against that reader's on every file the tests write.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CheckpointFormatError

SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
FLOAT32, STRING, ARRAY = 6, 8, 9
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4


class _Walk:
    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def fail(self, what: str, tensor: str | None = None) -> CheckpointFormatError:
        return CheckpointFormatError(self.path, what, tensor=tensor, offset=self.pos)

    def take(self, n: int, what: str, tensor: str | None = None) -> int:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes, only {self.size - self.pos} left in the file", tensor)
        start = self.pos
        self.pos += n
        return start

    def u(self, fmt: str, what: str) -> int:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self, what: str) -> str:
        n = self.u("<Q", f"length of {what}")
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        """The value as the `gguf` package's field.contents() gives it (arrays as lists)."""
        if vtype in SCALARS:
            return struct.unpack_from("<" + FORMATS[vtype], self.buf, self.take(SCALARS[vtype], f"value of {key}"))[0]
        if vtype == STRING:
            return self.string(f"value of {key}")
        if vtype == ARRAY and depth < MAX_NESTING:
            itype, count = self.u("<I", f"item type of {key}"), self.u("<Q", f"length of {key}")
            if itype in SCALARS:
                if count * SCALARS[itype] > self.size - self.pos:
                    raise self.fail(f"array {key} of {count} items is longer than the file")
                start = self.take(count * SCALARS[itype], f"array {key}")
                return list(struct.unpack_from(f"<{count}{FORMATS[itype]}", self.buf, start))
            if count * 8 > self.size - self.pos:  # every string or array item takes at least 8 bytes
                raise self.fail(f"array {key} of {count} items is longer than the file")
            if itype == STRING:  # the vocabularies: 100k+ items, read without the checks' per-item calls
                return self._strings(count, key)
            return [self.value(itype, key, depth + 1) for _ in range(count)]
        raise self.fail(f"metadata key {key!r} has unknown value type {vtype}")

    def _strings(self, count: int, key: str) -> list[str]:
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if size - pos < 8:
                self.pos = pos
                raise self.fail(f"length of an item of {key} needs 8 bytes, only {size - pos} left in the file")
            n = unpack(buf, pos)[0]
            pos += 8
            if n > size - pos:
                self.pos = pos
                raise self.fail(f"an item of {key} needs {n} bytes, only {size - pos} left in the file")
            try:
                out.append(buf[pos:pos + n].decode("utf-8"))
            except UnicodeDecodeError:
                self.pos = pos
                raise self.fail(f"an item of {key} is not valid UTF-8") from None
            pos += n
        self.pos = pos
        return out


@dataclass
class TensorInfo:
    name: str
    dims: list[int]  # GGUF order: innermost first
    gtype: int  # ggml type id
    offset: int  # absolute, in the file
    nbytes: int


@dataclass
class Header:
    metadata: dict[str, Any]  # key -> value (a float32 scalar kept at its shortest decimal: 1e-06)
    tensors: list[TensorInfo]
    alignment: int


def prescan(path: Path, known_types: dict[int, tuple[str, int, int]]) -> Header:
    """The header of `path` (magic and counts already checked), checked against its size, and every tensor's data
    range (inside the file, aligned, not overlapping another); `known_types`: ggml type id -> (name, values per
    block, bytes per block)."""
    metadata: dict[str, Any] = {}
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            raise CheckpointFormatError(path, "empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            w = _Walk(path, buf)
            w.take(8, "header")
            n_tensors, n_kv = w.u("<Q", "tensor count"), w.u("<Q", "key count")
            align = 32
            for _ in range(n_kv):
                key = w.string("metadata key")
                vtype = w.u("<I", f"type of {key}")
                if key == "general.alignment" and vtype == 4:
                    align = w.u("<I", key)
                    if align == 0 or align & (align - 1):
                        raise w.fail(f"general.alignment {align} is not a power of two")
                    metadata[key] = align
                    continue
                value = w.value(vtype, key)
                metadata[key] = float(f"{value:.7g}") if vtype == FLOAT32 else value
            spans, infos = [], []
            for _ in range(n_tensors):
                name = w.string("tensor name")
                n_dims = w.u("<I", "dimension count")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise w.fail(f"{n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})", name)
                dims = [w.u("<Q", "dimension") for _ in range(n_dims)]
                if any(d == 0 or d >= 2 ** 62 for d in dims):
                    raise w.fail(f"dimensions {dims} out of range", name)
                gtype = w.u("<I", "tensor type")
                if gtype not in known_types:
                    raise w.fail(f"unknown tensor type {gtype}", name)
                _, per, size = known_types[gtype]
                numel = 1
                for d in dims:
                    numel *= d
                if dims[0] % per:
                    raise w.fail(f"{dims[0]} values per row are not whole {known_types[gtype][0]} blocks", name)
                spans.append((w.u("<Q", "tensor data offset"), numel // per * size, name))
                infos.append((dims, gtype))
            start = -(-w.pos // align) * align
            del w
        _check_spans(path, spans, start, f.seek(0, 2), align)
    return Header(metadata, [TensorInfo(name, dims, gtype, start + offset, nbytes)
                             for (offset, nbytes, name), (dims, gtype) in zip(spans, infos)], align)


def _check_spans(path: Path, spans: list, start: int, size: int, align: int) -> None:
    """Tensor data ranges (relative to the aligned data start) inside the file, aligned, not overlapping."""
    for offset, nbytes, name in spans:
        if offset % align:
            raise CheckpointFormatError(path, f"data offset {offset} is not a multiple of the alignment {align}",
                                        tensor=name)
        if start + offset + nbytes > size:
            raise CheckpointFormatError(path, f"file truncated: byte range [{start + offset}, {start + offset + nbytes})"
                                              f" is past the end ({size} bytes)", tensor=name,
                                        hint=f"re-download {path.name}")
    ordered = sorted(spans)
    for (b0, e0, n0), (b1, _, n1) in zip(ordered, ordered[1:]):
        if b1 < b0 + e0:
            raise CheckpointFormatError(path, f"byte range starting at {start + b1} overlaps tensor '{n0}'", tensor=n1)
