"""GGUF headers (one file, or a `-00001-of-0000N.gguf` split set): metadata and tensor infos, read and checked by
one walk over each header (prescan.py; tests compare it with the `gguf` package's reader, llama.cpp's own) before
anything else is read.

Nothing here reads tensor data: the walk memory-maps each file (no allocation in proportion to a declared
size) and this module keeps, per tensor, its type, its shape (outermost dimension first, numpy order: GGUF
lists dimensions innermost first) and its absolute byte range. The engine's store reads those ranges itself.
Checks: magic and version, every tensor's range inside its file and aligned, no two ranges overlapping, split
sets complete and consistent; each error names the file and, where one is at fault, the tensor.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, CheckpointFormatError
from ..index import ShardInfo, _open_regular
from .prescan import Header, prescan

MAGIC = b"GGUF"
VERSIONS = (2, 3)
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_SPLITS = 9999


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    gtype: str  # GGML type name: F32, Q4_K, ...
    shape: tuple[int, ...]  # numpy order: outermost first (a fused expert tensor: [E, rows, cols])
    file: Path
    offset: int  # absolute, in `file`
    nbytes: int


@dataclass
class GGUFFile:
    path: Path  # the file named (the first of a split set)
    files: list[Path]
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    shards: list[ShardInfo] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def is_gguf(path: str | os.PathLike) -> bool:
    """A file whose name ends in .gguf (what --model takes as a GGUF file rather than a folder)."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" and not p.is_dir()


def split_files(path: Path) -> list[Path]:
    """The files of a split set named by any one of them (`name-00002-of-00003.gguf`), else [path]."""
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if not 1 <= count <= MAX_SPLITS or not 1 <= int(m["no"]) <= count:
        raise CheckpointFormatError(path, f"split file name says part {int(m['no'])} of {count}")
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise CheckpointError(files[0], f"GGUF split set incomplete: {', '.join(missing[:4])} missing "
                                        f"({len(missing)} of {count})", hint="download every part of the set")
    return files


def _check_magic(path: Path) -> ShardInfo:
    f, st = _open_regular(path, "GGUF file")
    with f:
        head = os.pread(f.fileno(), 24, 0)
    if len(head) < 24 or head[:4] != MAGIC:
        raise CheckpointFormatError(path, "not a GGUF file (no 'GGUF' magic at the start)"
                                    if head[:4] != MAGIC else f"file truncated: {st.st_size} bytes, no full header")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in VERSIONS:
        raise CheckpointFormatError(path, f"GGUF version {version} is not supported (supported: 2, 3)")
    # every tensor info takes at least 8 (name length) + 4 (dims) + 4 (type) + 8 (offset) bytes, every key 12
    if n_tensors * 24 > st.st_size or n_kv * 12 > st.st_size:
        raise CheckpointFormatError(path, f"header declares {n_tensors} tensors and {n_kv} metadata keys, more "
                                          f"than a {st.st_size}-byte file can hold")
    return ShardInfo(path, st.st_size, 0, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def _known_types() -> dict[int, tuple[str, int, int]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return {t.value: (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


def _tensors(path: Path, header: Header, types: dict[int, tuple[str, int, int]]) -> dict[str, GGUFTensor]:
    """The walk's tensor infos by name (ranges already checked: inside the file, aligned, not overlapping)."""
    out: dict[str, GGUFTensor] = {}
    for t in header.tensors:
        if t.name in out:
            raise CheckpointFormatError(path, "tensor name appears twice in the header", tensor=t.name)
        out[t.name] = GGUFTensor(t.name, types[t.gtype][0], tuple(reversed(t.dims)), path, t.offset, t.nbytes)
    return out


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Every tensor info and the metadata of a GGUF file or split set, checked; no tensor data is read."""
    first = Path(path)
    if not first.exists():
        raise CheckpointError(first, "GGUF file not found")
    files = split_files(first)
    metadata: dict[str, Any] = {}
    tensors: dict[str, GGUFTensor] = {}
    shards = []
    for i, file in enumerate(files):
        shard = _check_magic(file)
        types = _known_types()
        header = prescan(file, types)
        meta = header.metadata
        count = meta.get("split.count", 1)
        if len(files) > 1 and (count != len(files) or meta.get("split.no") != i):
            raise CheckpointFormatError(file, f"split metadata says part {meta.get('split.no')} of {count}, "
                                              f"the file name part {i} of {len(files)} (counting from 0)")
        if i == 0:
            metadata = meta
        for name, t in _tensors(file, header, types).items():
            if name in tensors:
                raise CheckpointFormatError(file, f"tensor also present in {tensors[name].file.name}", tensor=name)
            tensors[name] = t
        shards.append(shard)
    if "general.architecture" not in metadata:
        raise CheckpointFormatError(files[0], "metadata has no general.architecture")
    return GGUFFile(files[0], files, metadata, tensors, shards)
