"""Safetensors headers and the shard index, parsed and validated without reading tensor data.

Validation follows ../shared/RELIABILITY.md rules 1-2 and cases F1-F15: every header and the whole index are
checked (sizes against fstat, checked arithmetic, full coverage of each data section) before anything is
allocated in proportion to a declared size, and every error names the file and the tensor.
"""
from __future__ import annotations

import io
import json
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ..errors import CheckpointError, CheckpointFormatError, ConfigError
from .shard_paths import index_shard, shard_path
from .shard_paths import short as _short

HEADER_CAP = 100 * 1024 * 1024  # safetensors' own limit; OFFLOAD_ENGINE_HEADER_CAP overrides
_MAX_ELEMENTS = 2**63
_MAX_DIM = 2**63 - 1  # a dimension must fit an int64 even when another one is 0

# safetensors dtype -> (bits per element, torch dtype or None when torch cannot hold it directly)
DTYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "F64": (64, torch.float64), "F32": (32, torch.float32), "F16": (16, torch.float16), "BF16": (16, torch.bfloat16),
    "I64": (64, torch.int64), "I32": (32, torch.int32), "I16": (16, torch.int16), "I8": (8, torch.int8),
    "U8": (8, torch.uint8), "U16": (16, getattr(torch, "uint16", None)), "U32": (32, getattr(torch, "uint32", None)),
    "U64": (64, getattr(torch, "uint64", None)), "BOOL": (8, torch.bool),
    "F8_E4M3": (8, getattr(torch, "float8_e4m3fn", None)), "F8_E5M2": (8, getattr(torch, "float8_e5m2", None)),
    "F8_E8M0": (8, getattr(torch, "float8_e8m0fnu", None)), "F4": (4, None),
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
TORCH_DTYPE_NAMES = {"float32": "F32", "float": "F32", "float16": "F16", "half": "F16", "bfloat16": "BF16",
                     "float64": "F64"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes lie: `offset` is absolute within `file`."""

    name: str
    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = DTYPES[self.dtype][1]
        if dt is None:
            raise CheckpointFormatError(self.file, f"dtype {self.dtype} cannot be computed with by this torch build",
                                        tensor=self.name)
        return dt


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    size: int
    data_start: int
    identity: tuple[int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns), re-checked when a read fails
    metadata: Mapping[str, str] = field(default_factory=dict)


def _header_cap() -> int:
    raw = os.environ.get("OFFLOAD_ENGINE_HEADER_CAP")
    if raw is None:
        return HEADER_CAP
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"OFFLOAD_ENGINE_HEADER_CAP must be a number of bytes, found {raw!r}") from None


def _open_regular(path: Path, what: str) -> tuple[io.FileIO, os.stat_result]:
    """Open read-only and insist on a regular file. The type is checked before opening (a FIFO must not hang
    the loader) and again on the open file. The descriptor is owned by a file object from the moment the C-level
    open returns: a KeyboardInterrupt landing anywhere in the caller cannot leak it (the object closes it when
    dropped), which a bare os.open would."""
    try:
        before = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(path, f"{what} not found") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot stat {what}: {e.strerror}") from None
    if not stat.S_ISREG(before.st_mode):
        raise CheckpointFormatError(path, f"{what} is not a regular file")
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by the caller's `with`)
    except FileNotFoundError:
        raise CheckpointError(path, f"{what} not found") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot open {what}: {e.strerror}") from None
    try:
        st = os.fstat(f.fileno())
    except OSError as e:
        f.close()
        raise CheckpointError(path, f"cannot stat {what}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):  # replaced between the stat and the open
        f.close()
        raise CheckpointFormatError(path, f"{what} is not a regular file")
    return f, st


def _pread_exact(fd: int, path: Path, n: int, offset: int, what: str) -> bytes:
    try:
        raw = os.pread(fd, n, offset)
    except OSError as e:
        raise CheckpointError(path, f"cannot read {what}: {e.strerror}") from None
    if len(raw) != n:  # the file shrank after fstat
        raise CheckpointFormatError(path, f"short read of {what}: wanted {n} bytes, got {len(raw)}", offset=offset)
    return raw


def _parse_json(path: Path, text: str, what: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(path))
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(path, f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise CheckpointFormatError(path, f"{what} JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer literal longer than sys.get_int_max_str_digits()
        raise CheckpointFormatError(path, f"{what} is not acceptable JSON: {e}") from None


def _no_duplicates(path: Path):
    def hook(pairs: list[tuple[str, Any]]) -> dict:
        out = dict(pairs)  # C speed: an index of 10^5 tensors is one object
        if len(out) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise CheckpointFormatError(path, f"duplicate key {_short(key)} in JSON", tensor=None)
                seen.add(key)
        return out
    return hook


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_shard_header(path: Path) -> tuple[ShardInfo, list[TensorRecord]]:
    """Parse and fully validate one safetensors file's header against the file's real size."""
    f, st = _open_regular(path, "shard")
    with f:
        fd = f.fileno()
        size = st.st_size
        if size < 8:
            raise CheckpointFormatError(path, f"file shorter than the 8-byte header length (size {size} bytes)")
        (hlen,) = struct.unpack("<Q", _pread_exact(fd, path, 8, 0, "header length"))
        cap = _header_cap()
        if hlen > cap:
            raise CheckpointFormatError(path, f"declared header length {hlen} exceeds the cap of {cap} bytes",
                                        hint="raise OFFLOAD_ENGINE_HEADER_CAP if the file is trusted")
        if 8 + hlen > size:
            raise CheckpointFormatError(path, f"header length beyond the file: declared={hlen}, file_size={size}")
        raw = _pread_exact(fd, path, hlen, 8, "header")
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(path, f"header is not valid UTF-8 ({e.reason} at byte {8 + e.start})") from None
    del raw  # peak memory: one copy of a (possibly 100 MB) header at a time
    if not text.startswith("{"):
        raise CheckpointFormatError(path, "header does not start with '{' (not a safetensors file?)")
    header = _parse_json(path, text, "header")
    del text
    if not isinstance(header, dict):
        raise CheckpointFormatError(path, f"header must be a JSON object, found {type(header).__name__}")

    metadata = header.pop("__metadata__", None)
    if metadata is None:  # absent or null (safetensors' Option); any other non-object is malformed
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointFormatError(path, "__metadata__ must map strings to strings")

    data_start = 8 + hlen
    data_len = size - data_start
    records: list[TensorRecord] = []
    spans: list[tuple[int, int, str]] = []
    for name in list(header):  # each parsed entry is dropped as its (smaller) record is made: no double peak
        records.append(_validate_entry(path, name, header.pop(name), data_start, spans))
    _check_coverage(path, spans, data_len)
    return ShardInfo(path, size, data_start, identity, metadata), records


def _validate_entry(path: Path, name: str, entry: Any, data_start: int, spans: list) -> TensorRecord:
    if not isinstance(entry, dict):
        raise CheckpointFormatError(path, "header entry must be an object", tensor=name)
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointFormatError(path, f"unsupported dtype {_short(dtype)}; expected one of {sorted(DTYPES)}",
                                    tensor=name)
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape):
        raise CheckpointFormatError(path, f"shape must be a list of integers in [0, 2**63), found {_short(shape)}",
                                    tensor=name)
    if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) and o >= 0 for o in offs):
        raise CheckpointFormatError(path, f"data_offsets must be two non-negative integers, found {_short(offs)}",
                                    tensor=name)
    begin, end = offs
    if end < begin:
        raise CheckpointFormatError(path, f"data_offsets end {end} < begin {begin}", tensor=name)
    numel = 1
    for d in shape:
        numel *= d  # Python ints: no wrap-around; guarded below
        if numel > _MAX_ELEMENTS:
            raise CheckpointFormatError(path, f"shape {shape} has more than 2**63 elements", tensor=name)
    bits = DTYPES[dtype][0]
    if (numel * bits) % 8:
        raise CheckpointFormatError(path, f"{numel} elements of {dtype} are not a whole number of bytes", tensor=name)
    nbytes = numel * bits // 8
    if end - begin != nbytes:
        raise CheckpointFormatError(
            path, f"byte range [{begin}, {end}) holds {end - begin} bytes but shape {shape} x {dtype} needs {nbytes}",
            tensor=name)
    spans.append((begin, end, name))
    return TensorRecord(name, path, data_start + begin, nbytes, dtype, tuple(shape))




def _check_coverage(path: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """Tensors must tile the data section exactly: no overlap, no hole, no trailing bytes, nothing missing.

    Zero-size tensors take no bytes but must still lie inside the data section: their offset is used later."""
    spans.sort()
    past = [s for s in spans if s[1] > data_len]
    if past:  # before the tiling checks, so the message names a tensor past the end, not a hole it left
        begin, end, name = past[0]
        need = max(s[1] for s in past)
        raise CheckpointFormatError(
            path, f"shard truncated: expected {need} data bytes, have {data_len} "
                  f"(byte range [{begin}, {end}) is past the end)", tensor=name, hint=f"re-download {path.name}")
    pos, prev = 0, None
    for begin, end, name in spans:
        if begin == end:
            continue
        if begin < pos:
            raise CheckpointFormatError(path, f"byte range [{begin}, {end}) overlaps tensor '{prev}'", tensor=name)
        if begin > pos:
            raise CheckpointFormatError(path, f"data section not fully covered: hole of {begin - pos} bytes before it",
                                        tensor=name, offset=pos)
        pos, prev = end, name
    if pos < data_len:
        raise CheckpointFormatError(path, f"data section not fully covered: {data_len - pos} trailing bytes after the "
                                          f"last tensor", tensor=prev, offset=pos)  # the one they follow (or shrank)


JSON_CAP = 100 * 1024 * 1024  # config / index files; real ones are a few MB at most


def load_json(path: Path, what: str) -> dict:
    f, st = _open_regular(path, what)
    with f:
        if st.st_size > JSON_CAP:
            raise CheckpointFormatError(path, f"{what} is {st.st_size} bytes, over the {JSON_CAP}-byte cap")
        raw = _pread_exact(f.fileno(), path, st.st_size, 0, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(path, f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    data = _parse_json(path, text, what)
    if not isinstance(data, dict):
        raise CheckpointFormatError(path, f"{what} must be a JSON object")
    return data


class CheckpointIndex:
    """Every tensor of a Hugging Face folder: name -> TensorRecord, from headers alone."""

    def __init__(self, root: Path, config: dict, shards: list[ShardInfo], tensors: dict[str, TensorRecord],
                 absent: dict[str, Path] | None = None):
        self.root = root
        self.config = config
        self.shards = shards
        self.tensors = tensors
        self.absent = absent or {}  # tensor -> the shard the index maps it to, not in this folder (missing_ok)

    @classmethod
    def open(cls, path: str | os.PathLike, missing_shards_ok: bool = False) -> "CheckpointIndex":
        """missing_shards_ok: shards the index names but the folder lacks are left out (their tensors listed in
        `absent`) instead of refused: a pipeline rank with a local copy of only its layers' shards."""
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(root, "model folder not found (expected a folder with config.json and *.safetensors, "
                                        "or a .gguf file)")
        ggufs = sorted(p.name for p in root.glob("*.gguf"))
        if ggufs and not (root / "config.json").exists():
            raise CheckpointError(root, f"no config.json, but GGUF files: {', '.join(ggufs[:3])}",
                                  hint=f"pass the file itself: --model {root / ggufs[0]}")
        config = load_json(root / "config.json", "config.json")
        shard_paths, weight_map, index_path = cls._find_shards(root, missing_shards_ok)
        present = set(shard_paths)
        absent = {name: shard for name, shard in (weight_map or {}).items() if shard not in present}
        shards: list[ShardInfo] = []
        tensors: dict[str, TensorRecord] = {}
        for shard in shard_paths:
            info, records = read_shard_header(shard)
            shards.append(info)
            for rec in records:
                if rec.name in tensors:
                    raise CheckpointFormatError(shard, f"tensor also present in {tensors[rec.name].file.name}",
                                                tensor=rec.name)
                if weight_map is not None and weight_map.get(rec.name) != shard:
                    where = weight_map.get(rec.name)
                    raise CheckpointFormatError(
                        index_path, f"tensor found in shard {shard.name} but the index "
                                    f"{'does not list it' if where is None else 'maps it to ' + where.name}",
                        tensor=rec.name)
                tensors[rec.name] = rec
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in tensors and name not in absent:
                    raise CheckpointFormatError(index_path, f"index maps tensor to {shard.name}, which does not contain it",
                                                tensor=name)
        return cls(root, config, shards, tensors, absent)

    @staticmethod
    def _find_shards(root: Path, missing_ok: bool = False) -> tuple[list[Path], dict[str, Path] | None, Path | None]:
        index_path = root / "model.safetensors.index.json"
        if index_path.exists():
            index = load_json(index_path, "shard index")
            wm = index.get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise CheckpointFormatError(index_path, "'weight_map' must be a non-empty object of tensor -> shard file")
            weight_map: dict[str, Path] = {}
            by_rel: dict[str, Path] = {}  # ~10^5 entries name ~10^2 files: check each file name once
            by_real: dict[Path, Path] = {}  # "x", "./x" or two symlinks to one file: read it once
            present: set[Path] = set()
            for name, rel in wm.items():
                shard = by_rel.get(rel) if isinstance(rel, str) else None
                if shard is None:
                    found = index_shard(root, rel, index_path, name, by_real, missing_ok)
                    shard = by_rel[rel] = found if found is not None else root / rel
                    if found is not None:
                        present.add(found)
                weight_map[name] = shard
            return sorted(present), weight_map, index_path
        single = root / "model.safetensors"
        if single.exists() or single.is_symlink():
            shard_path(root, single.name, single)  # a symlink loop is named here
            return [single], None, None
        others = sorted(root.glob("*.safetensors"))
        if len(others) == 1:  # read_shard_header refuses it if it is not a regular file
            shard_path(root, others[0].name, others[0])
            return others, None, None
        if others:
            raise CheckpointError(root, f"{len(others)} .safetensors files but no model.safetensors.index.json",
                                  hint="restore the shard index from the original download")
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(root, f"pickle checkpoint refused ({', '.join(pickles)}): unpickling can execute code",
                                  hint="convert it to safetensors (e.g. safetensors' convert script) in a sandbox")
        raise CheckpointError(root, "no model.safetensors or model.safetensors.index.json in the folder")

    # ---- derived views --------------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.tensors.values())

    def names(self) -> Iterable[str]:
        return self.tensors.keys()
