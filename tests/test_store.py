"""Tiered store: identical output at every budget, tier layout and policy; hard budgets; located read faults."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from offload_engine import Budget, BudgetError, Engine, IOFault
from offload_engine.errors import ConfigError
from offload_engine.runtime.moe import routed_experts
from offload_engine.store.disk import read_range

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 33, 2, 77, 101, 9, 200]
NEW = 16
CONTEXT = 64


def run(path, **open_kw):
    with Engine.open(path, max_context=CONTEXT, **open_kw) as engine:
        logits = engine.logits(PROMPT)
        completion = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
        return logits, completion


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "deepseek_v3"])
def offload_model(request, checkpoint_factory):
    path = checkpoint_factory(request.param, "offload")
    logits, completion = run(path)  # fully resident reference
    return path, logits, completion


@pytest.mark.parametrize("ram", ["10%", "25%", "50%", "100%"])
def test_every_ram_budget_matches_resident(offload_model, ram):
    path, ref_logits, ref = offload_model
    logits, completion = run(path, budget=Budget(ram=ram))
    assert torch.equal(logits, ref_logits)  # bitwise: expert sums are formed in a fixed order
    assert completion.token_ids == ref.token_ids
    stats = completion.stats
    assert stats["peak_bytes"]["host"] <= stats["budget_bytes"]["host"]
    if ram != "100%":
        assert stats["bytes_read_disk"] > 0  # really streamed


@pytest.mark.parametrize("policy", ["lru-floor", "lru", "lfu", "layer-lru"])
@pytest.mark.parametrize("vram,ram", [("8%", "20%"), ("15%", None), ("8%", "100%")])
def test_three_tiers_and_policies_match_resident(offload_model, policy, vram, ram):
    """device pool (RAM on CPU) + host RAM + disk: every transition runs."""
    path, ref_logits, ref = offload_model
    logits, completion = run(path, budget=Budget(vram=vram, ram=ram), policy=policy)
    assert torch.equal(logits, ref_logits)
    assert completion.token_ids == ref.token_ids
    stats = completion.stats
    for tier in ("device", "host"):
        if stats["budget_bytes"][tier] is not None:
            assert stats["peak_bytes"][tier] <= stats["budget_bytes"][tier]
    if ram == "100%":
        assert stats["bytes_host_to_device"] > 0 and stats["hits"]["host"] > 0


def test_budget_below_minimum_refused_before_loading(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    threads = threading.active_count()
    with pytest.raises(BudgetError) as err:
        Engine.open(path, budget=Budget(ram="300KiB"), max_context=CONTEXT)
    e = err.value
    assert e.required > e.available == 300 * 1024
    assert {"expert x2", "dense x2", "kv cache"} <= set(e.breakdown)
    assert "minimum working set" in str(e)
    assert threading.active_count() == threads  # no reader thread was started


class Faulty:
    """A reader shim around the real read: fails the k-th call (EIO or short read), or sleeps."""

    def __init__(self, fail_at: int | None = None, mode: str = "eio", sleep: float = 0.0):
        self.calls, self.fail_at, self.mode, self.sleep = 0, fail_at, mode, sleep
        self.lock = threading.Lock()

    def __call__(self, files, r, blob):
        with self.lock:
            self.calls += 1
            fail = self.fail_at is not None and self.calls >= self.fail_at  # a failing disk keeps failing
        if self.sleep:
            time.sleep(self.sleep)
        if fail and self.mode == "eio":
            raise IOFault(r.file, r.file_offset, errno.EIO, "Input/output error (injected)")
        if fail and self.mode == "short":
            raise IOFault(r.file, r.file_offset + r.nbytes // 2, None, "unexpected end of file (injected)")
        read_range(files, r, blob)


@pytest.mark.parametrize("prefetch", [False, True])  # a failed prefetch is dropped; the demand read reports it
@pytest.mark.parametrize("mode", ["eio", "short"])
def test_read_fault_surfaces_with_shard_and_offset_and_engine_recovers(checkpoint_factory, mode, prefetch):
    path = checkpoint_factory("qwen3_moe", "offload")
    _, ref = run(path)
    baseline = threading.active_count()
    faulty = Faulty(fail_at=None, mode=mode)
    engine = Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, direct_io="off", read_fn=faulty,
                         prefetch=prefetch)
    faulty.fail_at = faulty.calls + 5  # during generation, not loading
    start = time.monotonic()
    with pytest.raises(IOFault) as err:
        engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
    assert time.monotonic() - start < 2.0
    assert ".safetensors" in str(err.value) and "offset" in str(err.value)
    faulty.fail_at = None  # the disk recovers
    again = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)  # usable, nothing half-read served
    assert again.token_ids == ref.token_ids
    engine.close()
    engine.close()  # idempotent
    deadline = time.monotonic() + 2
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == baseline


def test_throttled_reads_give_identical_tokens(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    _, ref = run(path)
    _, slow = run(path, budget=Budget(ram="25%"), direct_io="off", read_fn=Faulty(sleep=0.002))
    assert slow.token_ids == ref.token_ids
    stats, steps = slow.stats, len(slow.token_ids) - 1
    # stall_s_per_token counts the decode steps' waits only: the prefill (which misses most) waited too
    assert 0 < stats["stall_s_per_token"] * steps < stats["io_wait_s"]


SHM = Path("/dev/shm")


def _checkpoint_in_shm(folder: Path) -> Path | None:
    """A copy of `folder` in /dev/shm where its tmpfs takes O_DIRECT reads into memory aligned to only 4 bytes (as
    NVMe does), so the read that lands a unit page-aligned runs for real here; None where it does not."""
    if not SHM.is_dir():
        return None
    probe = SHM / f"offload-engine-probe-{os.getpid()}"
    try:
        probe.write_bytes(bytes(8192))
        fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            os.preadv(fd, [memoryview(bytearray(8192))[4:4 + 4096]], 512)
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        probe.unlink(missing_ok=True)
    copy = Path(tempfile.mkdtemp(dir=SHM))
    try:
        shutil.copytree(folder, copy, dirs_exist_ok=True)
    except OSError:  # a small /dev/shm (containers: 64 MB)
        shutil.rmtree(copy, ignore_errors=True)
        return None
    return copy


@pytest.mark.parametrize("alignment", ["page", "reported", "fine"])
def test_direct_read_lands_in_the_slot_without_a_bounce(checkpoint_factory, alignment, monkeypatch, request):
    """O_DIRECT straight into a slot with DIRECT_SLACK: every one-range unit's bytes equal a buffered read and
    begin at a page boundary (the CPU's prefetchers stop at pages), at whatever offset the unit starts in its
    shard and however the slot is aligned; units of several ranges and slots without the slack are declined (the
    caller bounces). Under each alignment a read may ask for: a page (where the system does not say), what this
    file system reports (statx), and NVMe's 4 bytes / 512 (on a tmpfs copy), where every read lands the unit
    in place instead of moving it."""
    from offload_engine.checkpoint.model import open_model
    from offload_engine.store import disk
    from offload_engine.constants import DIRECT_SLACK, PAGE
    from offload_engine.store.disk import (ALIGN, PAGE_DIRECT, DirectAlign, ShardFiles, direct_alignment, open_direct,
                                           read_unit, read_unit_direct)

    folder = checkpoint_factory("qwen3_moe", "offload")
    if alignment == "fine":
        folder = _checkpoint_in_shm(folder)
        if folder is None:
            pytest.skip("no tmpfs here with room for the checkpoint that takes O_DIRECT reads into 4-byte aligned "
                        "memory")
        request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    checkpoint = open_model(folder)
    files = ShardFiles(checkpoint.index.shards)
    fds, moves = {}, []
    memmove = disk.ctypes.memmove
    monkeypatch.setattr(disk.ctypes, "memmove", lambda *args: (moves.append(args), memmove(*args))[1])
    try:
        direct, declined = 0, 0
        for i, layout in enumerate(checkpoint.layouts.values()):
            file = layout.read_ranges()[0].file
            fd = fds.setdefault(file, open_direct(file, files))
            if fd is None:
                pytest.skip("this filesystem refuses O_DIRECT")
            align = {"page": PAGE_DIRECT, "reported": direct_alignment(fd), "fine": DirectAlign(4, 512)}[alignment]
            expected = torch.zeros(layout.nbytes, dtype=torch.uint8)
            read_unit(files, layout, expected)
            backing = torch.full((layout.nbytes + DIRECT_SLACK + 64,), 0xAB, dtype=torch.uint8)
            slot = backing[8 * (i % 8):][:layout.nbytes + DIRECT_SLACK]  # slots at several alignments
            at = read_unit_direct(fd, layout, slot, files, align)
            if at is None:
                declined += 1
                assert len(layout.read_ranges()) > 1
                continue
            direct += 1
            assert torch.equal(slot[at:at + layout.nbytes], expected), layout.key
            assert (slot.data_ptr() + at) % ALIGN == 0, layout.key
            views = layout.views(slot[at:])  # typed views of the unit where it landed
            assert all(v.data_ptr() % v.element_size() == 0 for v in views.values())
            # no slack: a slot of the unit's size that does not begin on a page cannot hold the aligned read
            # around it (whatever the unit's offset in its file), so it is declined
            spare = torch.empty(layout.nbytes + 2 * PAGE, dtype=torch.uint8)
            start = (64 - spare.data_ptr()) % PAGE
            assert read_unit_direct(fd, layout, spare[start:start + layout.nbytes], files, align) is None
        assert direct > 0
        if alignment != "reported":  # NVMe's alignment lands every unit; a page's moves those not on one
            assert (len(moves) == 0) == (alignment == "fine")
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
        files.close()


def test_direct_alignment_is_what_the_file_system_reports_or_a_page(tmp_path):
    from offload_engine.store.disk import ALIGN, PAGE_DIRECT, direct_alignment, open_direct

    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    fd = open_direct(path)
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    try:
        align = direct_alignment(fd)
        assert all(0 < a <= ALIGN and a & (a - 1) == 0 for a in (align.memory, align.offset))
    finally:
        os.close(fd)
    assert direct_alignment(-1) == PAGE_DIRECT  # statx fails: a page, which every filesystem accepts


def test_slot_indexes_agree_with_the_slots(checkpoint_factory):
    """The per-kind indexes a miss uses instead of scanning every slot (occupied slots by layer, free slots) agree
    with the slots themselves after requests that evict, prefetch and fail reads."""
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(vram="8%", ram="20%"), max_context=CONTEXT) as engine:
        for prompt in (PROMPT, PROMPT[::-1], PROMPT[3:]):
            engine.generate(prompt, max_new_tokens=8, ignore_eos=True)
        for tier in engine.store.tiers:
            for kind, pool in tier.pools.items():
                held = {s.index for s in pool if s.key is not None}
                indexed = [i for group in tier.by_layer.get(kind, {}).values() for i in group]
                assert sorted(indexed) == sorted(held), (tier.name, kind)
                for s in pool:
                    if s.key is not None:
                        assert tier.resident[s.key] is s and s.index in tier.by_layer[kind][s.key.layer]
                    else:
                        assert s in tier.free.get(kind, []), (tier.name, kind, s.index)


def test_recency_follows_the_sequence_not_the_landing_order(checkpoint_factory):
    """routed_experts orders a layer's experts as a token-by-token pass would last have used them (by last token,
    then routing weight) and acquire stamps recency in that order: a unit that lands after a resident one is
    still older when the caller listed it first, so a prefill leaves the last tokens' experts cached."""
    indices = torch.tensor([[3, 1], [2, 3], [5, 4]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    assert routed_experts(indices, weights) == [1, 3, 2, 5, 4]
    gen = torch.Generator().manual_seed(0)
    for T, E, k in ((1, 16, 4), (7, 8, 8), (40, 64, 8), (300, 32, 2)):  # the vectorized prefill path too
        idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        w = torch.softmax(torch.randn(T, k, generator=gen), -1)
        last = {e: (p, x) for p, (row, rw) in enumerate(zip(idx.tolist(), w.tolist())) for e, x in zip(row, rw)}
        assert routed_experts(idx, w) == sorted(last, key=last.__getitem__), (T, E, k)
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, prefetch=False) as engine:
        engine.generate(PROMPT, max_new_tokens=2, ignore_eos=True)
        store = engine.store
        resident = next(k for k in store.compute.resident if k.kind == "expert")
        missing = next(k for k in store.checkpoint.layouts
                       if k.kind == "expert" and k.layer == resident.layer and k not in store.compute.resident)
        landed = []
        for key, _ in store.acquire([missing, resident]):
            landed.append(key)
            store.release([key])
        assert landed == [resident, missing]  # resident first, the read after it
        assert store.compute.resident[missing].last_use < store.compute.resident[resident].last_use


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_embedding_rows_are_read_on_demand_when_not_pinned(checkpoint_factory, direct_io):
    """Below the budget that holds everything, the embedding gets no slot: a lookup reads the rows its distinct ids
    need (adjacent ids in one range), from the checkpoint, bytes equal to the table's rows; a read fault there
    names the shard and the row's offset; with a host tier that holds the rest, the rows come from its copy."""
    from safetensors import safe_open

    from offload_engine.checkpoint.naming import UnitKey

    path = checkpoint_factory("qwen3_moe", "offload")
    key = UnitKey(-1, "embed")
    faulty = Faulty()
    with Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, direct_io=direct_io,
                     read_fn=faulty) as engine:
        store = engine.store
        assert store.placement.by_rows("embed") and all("embed" not in t.pools for t in store.tiers)
        tensor = store.checkpoint.layouts[key].slices[0]
        with safe_open(tensor.file, "pt") as f:
            table = f.get_tensor("model.embed_tokens.weight")
        row_bytes = tensor.nbytes // tensor.shape[0]
        cache = store.row_caches[key]
        rows_read = store.stats.rows["read"]
        before = store.stats.bytes_read_disk
        w, ids = store.rows(key, torch.tensor([5, 3, 5, 4, 9]))
        assert store.stats.bytes_read_disk - before == 4 * row_bytes  # rows 3-5 and 9: two ranges, 4 rows
        assert ids.tolist() == [2, 0, 2, 1, 3] and torch.equal(w["weight"], table[[3, 4, 5, 9]])
        # the row cache: rows looked up lately are not read again; a new one is (and evicts the oldest when full)
        before = store.stats.bytes_read_disk
        w, ids = store.rows(key, torch.tensor([9, 2, 4]))
        assert store.stats.bytes_read_disk - before == row_bytes and torch.equal(w["weight"], table[[2, 4, 9]])
        assert ids.tolist() == [2, 0, 1] and cache.capacity >= 5
        many = torch.arange(10, 10 + cache.capacity)  # a prefill larger than what is left: keeps the last rows
        w, _ = store.rows(key, many)
        assert torch.equal(w["weight"], table[many])
        assert store.stats.rows["read"] - rows_read == 5 + cache.capacity and store.stats.rows["cached"] >= 2
        before = store.stats.bytes_read_disk
        last = int(many[-1])
        w, _ = store.rows(key, torch.tensor([9, last]))
        assert store.stats.bytes_read_disk - before == row_bytes and torch.equal(w["weight"], table[[9, last]])
        with pytest.raises(IndexError, match="outside"):
            store.rows(key, torch.tensor([tensor.shape[0]]))
        if direct_io == "off":
            faulty.fail_at = faulty.calls + 1
            with pytest.raises(IOFault) as err:
                store.rows(key, torch.tensor([7]))
            assert str(tensor.file) in str(err.value) and str(tensor.file_offset + 7 * row_bytes) in str(err.value)
            faulty.fail_at = None
            w, _ = store.rows(key, torch.tensor([7]))  # the failed read cached nothing: read again, right
            assert torch.equal(w["weight"], table[[7]])
    with Engine.open(path, budget=Budget(vram="20%", ram="100%"), max_context=CONTEXT) as engine:
        store = engine.store
        assert store.placement.home("embed") == "host" and "embed" not in store.compute.pools
        before = store.stats.bytes_read_disk
        w, ids = store.rows(key, torch.tensor([5, 3]))
        assert store.stats.bytes_read_disk == before and torch.equal(w["weight"], table[[3, 5]])
    with Engine.open(path, max_context=CONTEXT) as engine:  # everything fits: held whole, looked up in place
        assert engine.store is None or engine.store.rows(key, torch.tensor([1])) is None


def test_a_bad_gds_setting_is_refused_by_name(checkpoint_factory, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ENGINE_GDS", "maybe")
    with pytest.raises(ConfigError, match="OFFLOAD_ENGINE_GDS"):
        Engine.open(checkpoint_factory("qwen3_moe", "offload"), budget=Budget(ram="50%"))


def test_the_store_reads_through_the_io_it_is_given_and_reports_one_snapshot(checkpoint_factory):
    """TieredStore(io=...): every disk read and copy goes through the injected UnitIO (the fault tests' seam),
    which the store closes; snapshot() is the counters plus the ledger's budgets and peaks."""
    from offload_engine.checkpoint.model import open_model
    from offload_engine.checkpoint.naming import UnitKey
    from offload_engine.store.build import plan_for
    from offload_engine.store.ledger import Ledger
    from offload_engine.store.store import TieredStore, UnitIO
    from offload_engine.planner.placement import ResolvedBudget

    checkpoint = open_model(checkpoint_factory("qwen3_moe", "offload"))
    placement, _ = plan_for(checkpoint, ResolvedBudget(None, checkpoint.total_bytes // 4), torch.device("cpu"),
                            0, "off")
    seen: list[UnitKey] = []

    class Recording(UnitIO):
        def read(self, layout, slot):
            seen.append(layout.key)
            super().read(layout, slot)

    io = Recording(checkpoint.index.shards, torch.device("cpu"))
    ledger = Ledger({t.name: t.budget for t in placement.tiers})
    store = TieredStore(checkpoint, placement, ledger, torch.device("cpu"), torch.float32, io=io, prefetch_slots=3)
    try:
        keys = [k for k in checkpoint.layouts if k.kind == "expert"][:3]
        for key, _ in store.acquire(keys):
            store.release([key])
        assert set(keys) <= set(seen) and store.prefetch_slots == 3
        snap = store.snapshot()
        assert snap["bytes_read_disk"] == sum(checkpoint.layouts[k].nbytes for k in seen) > 0
        assert snap["budget_bytes"]["host"] == ledger.budgets()["host"] and snap["reads_in_flight"] == 0
        assert snap["peak_bytes"]["host"] == ledger.peak()["host"] > 0
    finally:
        store.close()
    with pytest.raises(IOFault, match="closed"):  # the store closed the I/O it was given
        io.files.fd(checkpoint.layouts[keys[0]].read_ranges()[0].file)
