"""RELIABILITY.md section 1 (F1-F16) and section 3 (P1, P5) on `CheckpointIndex.open`.

Every variant of tests/malformed.py must fail with a CheckpointError (never KeyError/ValueError/struct.error/
OverflowError/MemoryError...) within 5 s, naming the offending file and, where one applies, the tensor; F2/F3/F8
must not allocate in proportion to a declared size (peak RSS delta < 8 MB). The index reads headers only.
"""
from __future__ import annotations

import json
import mmap
import os
import pickle
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))
import malformed as m  # noqa: E402

from offload_engine.checkpoint.index import CheckpointIndex, read_shard_header  # noqa: E402
from offload_engine.errors import CheckpointError  # noqa: E402

OPEN_DEADLINE_S = 5.0
RSS_LIMIT = 8 * 2**20
RSS_SECTIONS = {"F2", "F3", "F8"}
READ_SLACK = 64 * 1024


@pytest.fixture(scope="module")
def valid_dir(tmp_path_factory) -> Path:
    return m.build_valid_checkpoint(tmp_path_factory.mktemp("valid") / "model")


# ---- measurement helpers ------------------------------------------------------------------------------------
def _can_reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar")


_PROBE = r"""
import resource, sys, json
from offload_engine.checkpoint.index import CheckpointIndex
from offload_engine.errors import CheckpointError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    CheckpointIndex.open(sys.argv[1]); kind = "ok"
except CheckpointError as e:
    kind = "CheckpointError"
except BaseException as e:
    kind = type(e).__name__
print(json.dumps([kind, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024]))
"""


def _peak_growth(fn):
    """Run fn(); returns (its result, seconds, growth of peak RSS in bytes). Needs /proc/self/clear_refs."""
    _can_reset_peak_rss()
    base = _vm_hwm()
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0, _vm_hwm() - base


def _try_open(model_dir: Path) -> CheckpointError | None:
    try:
        CheckpointIndex.open(model_dir)
    except CheckpointError as e:
        return e
    return None


def _open_measured(model_dir: Path, want_rss: bool):
    """Open the folder; returns (exception or None, seconds, peak RSS growth in bytes or None)."""
    reset = want_rss and _can_reset_peak_rss()
    err, elapsed, rss = _peak_growth(lambda: _try_open(model_dir))
    rss = rss if reset else None
    if want_rss and not reset:  # no clear_refs: measure in a fresh interpreter instead
        out = subprocess.run([sys.executable, "-c", _PROBE, str(model_dir)], capture_output=True, text=True,
                             timeout=60, env=os.environ.copy(), cwd=Path(__file__).parent.parent)
        kind, rss = json.loads(out.stdout.strip().splitlines()[-1])
        assert kind in ("ok", "CheckpointError"), out.stderr
    return err, elapsed, rss


def _no_payload_ran(tmp_path: Path) -> None:
    assert not list(tmp_path.rglob(m.SENTINEL)), "a pickle or auto_map payload was executed"
    assert not any(k.startswith(("modeling_evil", "configuration_evil")) for k in sys.modules)


# ---- the table ----------------------------------------------------------------------------------------------
def test_table_covers_the_plan():
    assert len(m.VARIANTS) >= 60
    sections = {v.section for v in m.VARIANTS}
    for needed in [f"F{i}" for i in range(1, 17) if i != 13] + ["P1", "P5"]:
        assert needed in sections, needed  # F13 needs the architecture: tests/test_config_validation.py


def test_peak_rss_probe_sees_a_32MB_allocation():
    if not _can_reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs: the variants measure in a subprocess instead")
    def touch_fresh_pages() -> mmap.mmap:
        # an anonymous mapping, held while the peak is read: fresh pages whatever the heap holds (a bytearray may
        # reuse memory the allocator kept resident from earlier tests: the peak did not move once in a full run)
        region = mmap.mmap(-1, 32 * 2**20)
        for offset in range(0, len(region), mmap.PAGESIZE):
            region[offset] = 1
        return region

    region, _, grown = _peak_growth(touch_fresh_pages)
    region.close()
    assert grown > 24 * 2**20, grown


def test_layout_matches_saved_files(valid_dir):
    for shard in (m.SHARD1, m.SHARD2):
        header, data = m.read_shard(valid_dir / shard)
        header.pop("__metadata__", None)
        got = sorted((n, *e["data_offsets"]) for n, e in header.items())
        assert got == sorted(m.layout(shard))
        assert len(data) == m.data_len(shard)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("variant", m.VARIANTS, ids=str)
def test_variant(variant, valid_dir, tmp_path, monkeypatch):
    for k, val in variant.env.items():
        monkeypatch.setenv(k, val)
    model_dir = m.materialize(variant, valid_dir, tmp_path / "model")
    err, elapsed, rss = _open_measured(model_dir, want_rss=variant.section in RSS_SECTIONS)
    assert elapsed < OPEN_DEADLINE_S, f"open took {elapsed:.1f}s"
    if rss is not None:
        assert rss < RSS_LIMIT, f"peak RSS grew by {rss / 2**20:.1f} MiB"
    _no_payload_ran(tmp_path)
    if variant.ok:
        assert err is None, f"tolerated variation refused: {err}"
        index = CheckpointIndex.open(model_dir)
        assert set(m.tensor_shapes()) & set(index.tensors)
        return
    assert err is not None, "malformed checkpoint accepted"
    msg = str(err)
    assert str(model_dir) in msg, msg
    if variant.expect_file == m.DIR:
        assert re.search(re.escape(str(model_dir)) + r"/?:", msg), msg
    elif variant.expect_file is not None:
        assert re.search(re.escape(variant.expect_file), msg), msg
    if variant.expect_tensor is not None:
        assert re.search("'" + re.escape(variant.expect_tensor) + "'", msg), msg
    for pattern in variant.expect_text:
        assert re.search(pattern, msg), (pattern, msg)
    assert len(msg) < 2000, "message should stay readable"


# ---- the valid fixture --------------------------------------------------------------------------------------
def test_valid_fixture_lists_every_tensor_with_correct_bytes(valid_dir):
    index = CheckpointIndex.open(valid_dir)
    shapes = m.tensor_shapes()
    assert set(index.tensors) == set(shapes)
    assert index.config["model_type"] == "llama"
    for shard in (m.SHARD1, m.SHARD2):
        fd = os.open(valid_dir / shard, os.O_RDONLY)
        try:
            with safe_open(str(valid_dir / shard), framework="pt") as f:
                for name in f.keys():
                    rec = index.tensors[name]
                    assert rec.file.name == shard and rec.shape == shapes[name] and rec.dtype == "F32"
                    expect = f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()
                    assert rec.nbytes == len(expect)
                    assert os.pread(fd, rec.nbytes, rec.offset) == expect, name
        finally:
            os.close(fd)
    assert index.total_bytes == json.loads((valid_dir / m.INDEX).read_text())["metadata"]["total_size"]


def test_index_reads_headers_only(valid_dir):
    CheckpointIndex.open(valid_dir)  # warm: lazy imports must not count
    before = _rchar()
    CheckpointIndex.open(valid_dir)
    read = _rchar() - before
    headers = sum(len(m.header_bytes(valid_dir / s)) + 8 for s in (m.SHARD1, m.SHARD2))
    json_files = sum((valid_dir / f).stat().st_size for f in (m.CONFIG, m.INDEX))
    assert read < headers + json_files + READ_SLACK, read


def test_unreadable_data_section_still_lists_everything(tmp_path, valid_dir):
    """A valid header over a 1 GiB sparse hole: listing it must not touch the data (rchar barely moves)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / m.CONFIG).write_bytes((valid_dir / m.CONFIG).read_bytes())
    elems = 2**27  # 512 MiB of F32 each
    header = {"__metadata__": {"format": "pt"},
              "big.a": {"dtype": "F32", "shape": [elems], "data_offsets": [0, 4 * elems]},
              "big.b": {"dtype": "BF16", "shape": [2, elems], "data_offsets": [4 * elems, 8 * elems]}}
    shard = model / "model.safetensors"
    m.write_shard(shard, header, b"")
    os.truncate(shard, shard.stat().st_size + 8 * elems)
    CheckpointIndex.open(valid_dir)
    before = _rchar()
    index = CheckpointIndex.open(model)
    read = _rchar() - before
    assert read < len(m.header_bytes(shard)) + 8 + (model / m.CONFIG).stat().st_size + READ_SLACK, read
    assert index.tensors["big.a"].nbytes == 4 * elems and index.tensors["big.b"].shape == (2, elems)
    assert index.tensors["big.b"].offset == 8 + len(m.header_bytes(shard)) + 4 * elems


def _assert_reads_like(index: CheckpointIndex, valid_dir: Path) -> None:
    """Every tensor of `index` has the bytes the valid fixture's shards hold for it."""
    assert set(index.tensors) == set(m.tensor_shapes())
    for shard in (m.SHARD1, m.SHARD2):
        with safe_open(str(valid_dir / shard), framework="pt") as f:
            for name in f.keys():
                rec = index.tensors[name]
                expect = f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()
                with open(rec.file, "rb") as g:  # through the symlink, as the store opens it
                    g.seek(rec.offset)
                    assert g.read(rec.nbytes) == expect, name


def test_hugging_face_cache_snapshot_symlinks_to_blobs_are_allowed(tmp_path, valid_dir):
    """hub cache layout: <repo>/snapshots/<rev>/<file> -> ../../blobs/<sha>."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in os.listdir(valid_dir):
        (blobs / f"sha-{f}").write_bytes((valid_dir / f).read_bytes())
        os.symlink(f"../../blobs/sha-{f}", snap / f)
    _assert_reads_like(CheckpointIndex.open(snap), valid_dir)
    # a symlink to a regular file anywhere else is followed too (RELIABILITY.md F15: files spread over disks)
    (repo / "refs").mkdir()
    os.replace(blobs / f"sha-{m.SHARD1}", repo / "refs" / "moved")
    os.unlink(snap / m.SHARD1)
    os.symlink("../../refs/moved", snap / m.SHARD1)
    _assert_reads_like(CheckpointIndex.open(snap), valid_dir)


def test_symlinked_shards_outside_the_folder_are_read_correctly(tmp_path, valid_dir):
    """A `--local-dir` download: the folder holds symlinks (absolute and relative) to shards kept elsewhere."""
    elsewhere, model = tmp_path / "disk2" / "blobs", tmp_path / "model"
    elsewhere.mkdir(parents=True)
    model.mkdir()
    for f in os.listdir(valid_dir):
        (elsewhere / f).write_bytes((valid_dir / f).read_bytes())
    os.symlink(elsewhere / m.SHARD1, model / m.SHARD1)
    os.symlink(f"../disk2/blobs/{m.SHARD2}", model / m.SHARD2)
    for f in (m.CONFIG, m.INDEX):
        os.symlink(elsewhere / f, model / f)
    index = CheckpointIndex.open(model)
    assert {r.file for r in index.tensors.values()} == {model / m.SHARD1, model / m.SHARD2}
    _assert_reads_like(index, valid_dir)


@pytest.mark.parametrize("rel, why", [("../model/" + m.SHARD1, "'..' component"), ("sub/../" + m.SHARD1, "'..' component"),
                                      ("/etc/passwd", "absolute path")])
def test_index_names_with_dotdot_or_absolute_are_refused_even_when_they_would_resolve(tmp_path, valid_dir, rel, why):
    """The rule is on the name, not where it lands: `..` and absolute names are refused by name."""
    model = m.materialize(m.Variant("x", "F15", m.edit_index(lambda i: i["weight_map"].update({m.T1: rel})), m.T1),
                          valid_dir, tmp_path / "model")
    (model / "sub").mkdir()
    with pytest.raises(CheckpointError, match="escapes model directory") as e:
        CheckpointIndex.open(model)
    msg = str(e.value)
    assert m.INDEX in msg and why in msg and m.T1 in msg and repr(rel) in msg, msg


def test_mixed_folder_never_unpickles(tmp_path, valid_dir, monkeypatch):
    """P5: safetensors chosen; torch.load and pickle are never called (and the payload's sentinel never appears)."""
    def boom(*a, **k):
        raise AssertionError("pickle path touched")
    for mod, attr in [(torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")]:
        monkeypatch.setattr(mod, attr, boom)
    model = m.materialize(m.Variant("mixed", "P5", m.evil_pickle("pytorch_model.bin"), None), valid_dir,
                          tmp_path / "model")
    index = CheckpointIndex.open(model)
    assert set(index.tensors) == set(m.tensor_shapes())
    assert all(r.file.suffix == ".safetensors" for r in index.tensors.values())
    _no_payload_ran(tmp_path)


def test_payloads_are_live(tmp_path):
    """The sentinel checks mean something: the payloads really do fire when (unsafely) executed."""
    evil = tmp_path / "evil.bin"
    evil.write_bytes(m.evil_pickle_bytes(tmp_path / "fired_pickle"))
    with pytest.raises(Exception):
        torch.load(evil, weights_only=True)  # the safe path refuses ...
    assert not (tmp_path / "fired_pickle").exists()
    torch.load(evil, weights_only=False)  # ... the unsafe one runs it
    assert (tmp_path / "fired_pickle").exists()
    (tmp_path / "modeling_evil.py").write_text(m.EVIL_MODULE)
    subprocess.run([sys.executable, str(tmp_path / "modeling_evil.py")], check=True, timeout=60)
    assert (tmp_path / m.SENTINEL).exists()


def test_truncation_is_reported_before_any_read_and_without_sigbus(tmp_path, valid_dir):
    """F10: a truncated shard fails at open in a subprocess with a normal exit (no SIGBUS/SIGSEGV)."""
    model = m.materialize(m.Variant("t", "F10", m.truncate_data(m.SHARD2, m.D2 // 3), None), valid_dir,
                          tmp_path / "model")
    code = ("import sys\nfrom offload_engine.checkpoint.index import CheckpointIndex\n"
            "from offload_engine.errors import CheckpointError\n"
            "try:\n    CheckpointIndex.open(sys.argv[1])\nexcept CheckpointError as e:\n"
            "    print(e); sys.exit(2)\n")
    out = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "truncated" in out.stdout and m.SHARD2 in out.stdout


def test_read_shard_header_directly_names_the_file(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 2) + b"{}")
    info, records = read_shard_header(p)
    assert records == [] and info.data_start == 10
    p.write_bytes(struct.pack("<Q", 2) + b"{}" + b"x")
    with pytest.raises(CheckpointError, match=re.escape(str(p))):
        read_shard_header(p)
