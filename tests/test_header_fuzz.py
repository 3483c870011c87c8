"""F17: fuzzing `read_shard_header` (hypothesis). Only CheckpointError subclasses or success, never a crash or hang.

Two generators: byte-level mutations of a valid file (flips, overwrites, insertions, deletions, truncations,
length-prefix rewrites, JSON token swaps), and JSON-ish headers built from scratch. On success the records
must really tile the file. Each example is written to one reused path.

CI runs 10^4 examples in total, split between the two generators. Run long (nightly), e.g.:
    OFFLOAD_ENGINE_FUZZ_EXAMPLES=1000000 .venv/bin/python -m pytest -q tests/test_header_fuzz.py -p no:timeout
"""
from __future__ import annotations

import json
import os
import re
import struct
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import save

from offload_engine.checkpoint.index import DTYPES, read_shard_header
from offload_engine.errors import CheckpointError

EXAMPLES = int(os.environ.get("OFFLOAD_ENGINE_FUZZ_EXAMPLES", "10000"))
PER_CALL_S = 2.0
# the byte-mutation generator is ~5x cheaper per example than the JSON one: it gets 80 % of the examples
_COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
FUZZ_MUTATED = settings(max_examples=max(1, EXAMPLES * 4 // 5), **_COMMON)
FUZZ_GENERATED = settings(max_examples=max(1, EXAMPLES // 5), **_COMMON)

# a small valid file with several dtypes, a zero-size tensor and metadata: mutations reach every check
BASE = save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
             "c": torch.zeros(3, dtype=torch.int8), "e": torch.zeros(0, 5)}, metadata={"format": "pt"})
INTERESTING_INTS = [0, 1, -1, 7, 8, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                    10**30, -(2**63)]
INTERESTING_TOKENS = [str(i) for i in INTERESTING_INTS] + ["1.0", "-0.0", "1e308", "1e999", "NaN", "-Infinity",
                                                          "null", "true", '""', "[]", "{}", '"F32"', "9" * 5000]
DTYPE_NAMES = sorted(DTYPES) + ["Q9", "f32", "", "F8", "F4 ", "BOOL\u0000"]
NUMBER = re.compile(rb"-?\d+")


class _Target:
    """One file rewritten in place per example. ftruncate + pwrite on an open fd: reopening with O_TRUNC
    costs ~3 ms on some filesystems, which would dominate the run."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def write(self, blob: bytes) -> Path:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, blob, 0)
        return self.path


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    t = _Target(tmp_path_factory.mktemp("fuzz") / "x.safetensors")
    yield t
    os.close(t.fd)


def _check(target: _Target, blob: bytes) -> None:
    path = target.write(blob)
    t0 = time.monotonic()
    try:
        info, records = read_shard_header(path)
    except CheckpointError as e:
        assert str(path) in str(e)
    else:
        _assert_tiles(info, records, len(blob))
    assert time.monotonic() - t0 < PER_CALL_S


def _assert_tiles(info, records, size: int) -> None:
    """A header that passes must describe the file exactly."""
    assert 8 <= info.data_start <= size == info.size
    pos = info.data_start
    for r in sorted((r for r in records if r.nbytes), key=lambda r: r.offset):
        assert r.offset == pos and r.nbytes > 0
        pos += r.nbytes
    assert pos == size
    for r in records:
        assert info.data_start <= r.offset <= size and r.dtype in DTYPES


# ---- generator 1: byte-level mutations of a valid file -------------------------------------------------------
# hypothesis draws one byte string, read as a mutation program (the FuzzedDataProvider pattern of atheris):
# one draw per example keeps 10^4 examples fast, and shrinking still minimises the program.
class _Program:
    def __init__(self, raw: bytes):
        self.raw, self.i = raw, 0

    def more(self) -> bool:
        return self.i < len(self.raw)

    def byte(self) -> int:
        self.i += 1
        return self.raw[self.i - 1] if self.i <= len(self.raw) else 0

    def below(self, n: int) -> int:
        """An int in [0, n) from two bytes (n > 0)."""
        return (self.byte() << 8 | self.byte()) % n

    def pick(self, seq):
        return seq[self.byte() % len(seq)]

    def take(self, n: int) -> bytes:
        return bytes(self.byte() for _ in range(n))


def _set_prefix(buf: bytearray, value: int) -> None:
    buf[:8] = struct.pack("<Q", value % 2**64)


def mutate(program: bytes) -> bytes:
    buf, prog = bytearray(BASE), _Program(program)
    while prog.more():
        op, n = prog.byte() % 8, len(buf)
        if op == 0 and n:  # flip a bit
            buf[prog.below(n)] ^= 1 << (prog.byte() % 8)
        elif op == 1 and n:  # overwrite a byte, often with a JSON-significant one
            buf[prog.below(n)] = prog.pick(b'{}[]",:0123456789-. \x00\xff\xc3') if prog.byte() % 2 else prog.byte()
        elif op == 2:  # insert 1..16 bytes
            i = prog.below(n + 1)
            buf[i:i] = prog.take(1 + prog.byte() % 16)
        elif op == 3 and n:  # delete 1..16 bytes
            i = prog.below(n)
            del buf[i:i + 1 + prog.byte() % 16]
        elif op == 4:  # truncate
            del buf[prog.below(n + 1):]
        elif op == 5 and n >= 8:  # rewrite the length prefix
            (cur,) = struct.unpack("<Q", bytes(buf[:8]))
            choice = prog.byte() % 3
            value = (cur + prog.pick([1, -1, 8, -8, 2**32]) if choice == 0 else prog.pick(INTERESTING_INTS)
                     if choice == 1 else int.from_bytes(prog.take(8), "little"))
            _set_prefix(buf, value)
        elif op in (6, 7) and n >= 8:
            _swap_token(prog, buf, "token" if op == 6 else "dtype")
    return bytes(buf)


def _swap_token(prog: _Program, buf: bytearray, op: str) -> None:
    """Replace one number (or dtype string) inside the header and fix the length prefix, so the JSON stays
    well-formed and the deeper checks (offsets, shapes, dtypes, coverage) are what gets exercised."""
    (hlen,) = struct.unpack("<Q", bytes(buf[:8]))
    if hlen > len(buf) - 8:
        return
    header = bytes(buf[8:8 + hlen])
    if op == "token":
        spots = [(mt.start(), mt.end()) for mt in NUMBER.finditer(header)]
        new = prog.pick(INTERESTING_TOKENS).encode()
    else:
        spots = [(mt.start(1), mt.end(1)) for mt in re.finditer(rb'"dtype":"([^"]*)"', header)]
        new = prog.pick(DTYPE_NAMES).encode()
    if not spots:
        return
    a, b = prog.pick(spots)
    header = header[:a] + new + header[b:]
    buf[8:8 + hlen] = header
    _set_prefix(buf, len(header))


@FUZZ_MUTATED
@given(program=st.binary(min_size=1, max_size=64))
def test_fuzz_mutated_valid_file(target, program):
    _check(target, mutate(program))


# ---- generator 2: JSON-ish headers from scratch ----------------------------------------------------------------
# few draws per example (hypothesis' cost is per draw): small fixed vocabularies instead of free text
WORDS = ["", "a", "b", "dtype", "shape", "data_offsets", "F32", "\u00e9", "\ud800", "__metadata__", "x" * 300]
json_scalars = (st.none() | st.booleans() | st.sampled_from(INTERESTING_INTS) | st.integers(-10, 300)
                | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(WORDS))
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.sampled_from(WORDS), kids, max_size=3), max_leaves=5)
small_or_weird_int = st.integers(0, 64) | st.sampled_from(INTERESTING_INTS)


@st.composite
def plausible_entry(draw, data_len: int):
    shape = draw(st.lists(small_or_weird_int, max_size=3))
    begin = draw(st.integers(0, data_len) | small_or_weird_int)
    end = draw(st.integers(0, data_len) | st.just(begin))
    entry = {"dtype": draw(st.sampled_from(DTYPE_NAMES)), "shape": shape, "data_offsets": [begin, end]}
    if draw(st.integers(0, 3)) == 0:  # perturb one field with an arbitrary JSON value
        entry[draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(json_values)
    return entry


@st.composite
def generated_files(draw) -> bytes:
    if draw(st.booleans()):  # a well-tiled layout half the time, so success paths are fuzzed too
        header, data_len = _tile(draw)
    else:
        data_len = draw(st.integers(0, 128))
        names = draw(st.lists(st.sampled_from(["a", "b", "c", "", "\u00e9", "__metadata__"]), max_size=4,
                              unique=True))
        header = {n: (draw(st.dictionaries(st.sampled_from(WORDS), json_scalars, max_size=2) | json_scalars)
                      if n == "__metadata__" else draw(plausible_entry(data_len) | json_values)) for n in names}
    text = json.dumps(header, allow_nan=True).encode() + b" " * draw(st.sampled_from([0, 0, 1, 7]))
    declared = len(text) + draw(st.sampled_from([0] * 6 + [1, -1, 8]))
    return struct.pack("<Q", max(declared, 0)) + text + b"\0" * data_len


def _tile(draw):
    """A valid header (F32/F16/I8/U8/F4 tensors back to back), occasionally nudged off by one."""
    header, pos = {}, 0
    for i in range(draw(st.integers(0, 5))):
        dtype = draw(st.sampled_from(["F32", "F16", "I8", "U8", "F4", "BF16"]))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        numel = 1
        for d in shape:
            numel *= d
        nbytes = (numel * DTYPES[dtype][0] + 7) // 8
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    nudge = draw(st.sampled_from([0, 0, 0, 1, -1])) if pos else 0
    return header, pos + nudge


@FUZZ_GENERATED
@given(blob=generated_files())
def test_fuzz_generated_headers(target, blob):
    _check(target, blob)


def test_base_file_is_valid(target):
    info, records = read_shard_header(target.write(BASE))
    assert {r.name for r in records} == {"a", "b", "c", "e"} and info.metadata == {"format": "pt"}
    _assert_tiles(info, records, len(BASE))
