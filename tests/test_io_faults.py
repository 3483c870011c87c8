"""I/O faults under the readers (RELIABILITY 4: I1-I6, 7: D4/D5; issue 9 item 3).

Faults are injected at the system-call level: `FaultyOS` stands in for the `os` module inside
`offload_engine.store.disk`, so every pread of the buffered and the O_DIRECT readers passes through it and can
fail with EIO, hit an early end of file, return fewer bytes than asked, sleep, or block until released. The
engine's own code builds the errors, so these tests check what a user would see from a failing disk. A few tests
use the reader interface itself (`Engine.open(read_fn=...)`) for faults above the system call.

Every surfaced fault must be an IOFault (an engine error) naming the shard and the offset that failed, within
2 s of the fault; reader threads and file descriptors go back to their baseline; the engine serves the next
request, and what it serves is bitwise what a clean engine serves (no half-read unit is ever cached).

OFFLOAD_ENGINE_FAULT_TRIALS scales the randomized trials (default 1).
"""
from __future__ import annotations

import errno
import os
import random
import shutil
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from offload_engine import Budget, Engine, IOFault, OffloadEngineError, PrefetchConfig
from offload_engine.store import disk
from offload_engine.errors import IOStallError
from offload_engine.store.disk import ALIGN, read_range
from offload_engine.store.readers import ReaderPool, reading
from tests.figures import Figures

SCALE = float(os.environ.get("OFFLOAD_ENGINE_FAULT_TRIALS", 1))
CONTEXT = 64
SURFACE_S = 2.0  # a fault reaches the caller within this long
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [300, 301, 7, 7, 7, 9],
           [64, 128, 33, 2, 77, 101, 9, 200, 14, 15], [400, 12, 13, 250, 250, 1]]
FIGURES = Figures("io-faults")
report_figures = FIGURES.fixture()
tally = FIGURES.tally




# ---- injection ------------------------------------------------------------------------------------------------

@dataclass
class Injection:
    path: str
    offset: int
    mode: str
    at: float  # time.monotonic()


@dataclass
class FaultyOS:
    """The `os` module as seen by offload_engine.store.disk, with a faulty `preadv`."""

    seed: int = 0
    calls: int = 0
    fail_from: int | None = None  # preadv call number (1-based) from which reads fail
    persistent: bool = True  # a failing disk keeps failing until disarm(); else only that one call fails
    mode: str = "eio"  # eio | eof | stall
    partial: float = 0.0  # probability that a read returns fewer bytes than asked (legal; must be handled)
    sleep_max: float = 0.0  # each read sleeps uniform(0, sleep_max) seconds
    injected: list[Injection] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._rng = random.Random(self.seed)

    def __getattr__(self, name):
        return getattr(os, name)

    def arm(self, k: int, mode: str = "eio", persistent: bool = True) -> None:
        with self._lock:
            self.fail_from, self.mode, self.persistent = self.calls + k, mode, persistent
            self.injected = []

    def heal(self) -> None:
        """New reads succeed; reads already blocked stay blocked until release is set."""
        with self._lock:
            self.fail_from = None

    def disarm(self) -> None:
        self.heal()
        self.release.set()

    def preadv(self, fd, buffers, offset):
        with self._lock:
            self.calls += 1
            n = self.calls
            fail = self.fail_from is not None and (n == self.fail_from or (self.persistent and n > self.fail_from))
            mode = self.mode
            if fail:
                self.injected.append(Injection(os.path.realpath(f"/proc/self/fd/{fd}"), offset, mode,
                                               time.monotonic()))
            nap = self._rng.uniform(0, self.sleep_max) if self.sleep_max else 0.0
            cut = self._rng.random() if self.partial and self._rng.random() < self.partial else None
        if nap:
            time.sleep(nap)
        if fail and mode == "eio":
            raise OSError(errno.EIO, "Input/output error (injected)")
        if fail and mode == "eof":
            return 0
        if fail and mode in ("stall", "stall-then-eio"):
            self.release.wait()  # a read that does not return until the test says so
            if mode == "stall-then-eio":
                raise OSError(errno.EIO, "Input/output error (injected, after a stall)")
        got = os.preadv(fd, buffers, offset)
        if cut is not None and got > 1:
            got = max(1, int(got * cut))  # the caller must trust only these bytes and read on
        return got


@pytest.fixture
def faulty_os(monkeypatch):
    fos = FaultyOS(seed=int(os.environ.get("OFFLOAD_ENGINE_FAULT_SEED", 0)))
    monkeypatch.setattr(disk, "os", fos)
    yield fos
    fos.disarm()  # never leave a reader blocked


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("offload-reader")]


def back_to_baseline(threads: int, fds: int, timeout: float = 3.0) -> bool:
    """No more threads and descriptors than before (fewer is fine: an earlier test's leftovers may go away)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if threading.active_count() <= threads and open_fds() <= fds:
            return True
        time.sleep(0.02)
    raise AssertionError(f"threads {threading.active_count()} (baseline {threads}): "
                         f"{[t.name for t in threading.enumerate()]}; descriptors {open_fds()} (baseline {fds})")


def settle_reads(engine: Engine, timeout: float = 3.0) -> None:
    """Wait until no slot has a read in flight (reads issued while the disk was failing have finished)."""
    store = engine.store
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [s for s in store.slot_states() if s.reading]
        if not busy:
            return
        time.sleep(0.01)


def assert_located(err: BaseException, injected: list[Injection], direct: bool) -> None:
    """An engine IOFault naming a shard and an offset that really failed."""
    assert isinstance(err, IOFault) and isinstance(err, OffloadEngineError), repr(err)
    msg = str(err)
    assert ".safetensors" in msg and f"offset {err.offset}" in msg, msg
    assert injected, "an error surfaced but nothing was injected"
    path = os.path.realpath(err.path)
    offsets = [i.offset for i in injected if i.path == path]
    assert offsets, (msg, injected[:3])
    slack = ALIGN if direct else 1  # O_DIRECT reports the byte it wanted inside the aligned block it read
    assert any(o <= err.offset < o + slack for o in offsets), (err.offset, offsets[:5])


# ---- models and references --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    arch: str
    vram: str | None
    ram: str
    direct_io: str
    prefetch: bool
    trials: int  # O_DIRECT requests are several times slower here (no page cache): fewer of them

    def open(self, path, **kw) -> Engine:
        return Engine.open(path, budget=Budget(vram=self.vram, ram=self.ram), max_context=CONTEXT,
                           direct_io=self.direct_io, prefetch=self.prefetch_config(), **kw)

    def prefetch_config(self) -> PrefetchConfig | bool:
        """Prefetch that never turns itself off (adaptive=False): faults must also hit prefetch reads."""
        return PrefetchConfig(adaptive=False) if self.prefetch else False

    def __str__(self):
        return f"{self.arch}-vram{self.vram}-ram{self.ram}-direct_{self.direct_io}-prefetch{int(self.prefetch)}"


CONFIGS = [
    Config("qwen3_moe", None, "10%", "off", True, 40),
    Config("qwen3_moe", "8%", "20%", "off", True, 40),  # compute slots + a host cache tier + disk
    Config("mixtral", None, "10%", "on", False, 12),  # O_DIRECT reads through the bounce buffers
    Config("deepseek_v3", None, "25%", "auto", True, 12),  # auto: O_DIRECT, the weights exceed the RAM budget
]

_REFS: dict[str, dict] = {}


def references(checkpoint_factory, arch: str) -> tuple[Path, dict]:
    """Fully resident engine: logits per prompt and a greedy completion of PROMPTS[0]."""
    path = checkpoint_factory(arch, "offload")
    if arch not in _REFS:
        with Engine.open(path, max_context=CONTEXT) as engine:
            _REFS[arch] = {"logits": [engine.logits(p) for p in PROMPTS],
                           "tokens": engine.generate(PROMPTS[0], max_new_tokens=6, ignore_eos=True).token_ids}
    return path, _REFS[arch]


# ---- I1/I2/D5: random EIO and early EOF during generation (and prefetch) ----------------------------------------

@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_random_read_faults_during_generation(checkpoint_factory, faulty_os, config):
    path, ref = references(checkpoint_factory, config.arch)
    rng = random.Random(zlib.crc32(str(config).encode()))
    trials = max(4, int(config.trials * SCALE))
    threads, fds = threading.active_count(), open_fds()
    engine = config.open(path)
    try:
        prefetch_failed0 = getattr(engine.store.stats, "prefetch_failed", 0)
        calls = 0
        for i in range(len(PROMPTS)):  # warm up: how many reads a request does from a part-filled cache
            start = faulty_os.calls
            assert torch.equal(engine.logits(PROMPTS[i]), ref["logits"][i])
            calls = max(calls, faulty_os.calls - start)
        injected = surfaced = absorbed = 0
        for trial in range(trials):
            i = rng.randrange(len(PROMPTS))
            mode = rng.choice(["eio", "eio", "eof"])
            persistent = rng.random() < 0.8
            faulty_os.arm(rng.randint(1, max(1, calls)), mode, persistent)
            use_generate = trial % 6 == 0
            start = faulty_os.calls
            try:
                if use_generate:
                    out = engine.generate(PROMPTS[0], max_new_tokens=6, ignore_eos=True).token_ids
                else:
                    out = engine.logits(PROMPTS[i])
                err = None
            except BaseException as e:  # noqa: BLE001 - anything that is not our located error fails below
                err, raised_at = e, time.monotonic()
            faulty_os.disarm()
            settle_reads(engine)  # (a read still failing after the disk healed: see the inherited-read test)
            calls = max(calls // 2, faulty_os.calls - start, 1)
            if faulty_os.injected:
                injected += 1
            if err is not None:
                surfaced += 1
                assert_located(err, faulty_os.injected, engine.store.direct_io)
                assert raised_at - faulty_os.injected[0].at < SURFACE_S
            elif faulty_os.injected:  # a failed prefetch is dropped and read again on demand: same output
                absorbed += 1
                assert out == ref["tokens"] if use_generate else torch.equal(out, ref["logits"][i])
            # the retry is served exactly what a clean engine serves: nothing half-read was kept
            if use_generate:
                assert engine.generate(PROMPTS[0], max_new_tokens=6, ignore_eos=True).token_ids == ref["tokens"]
            else:
                assert torch.equal(engine.logits(PROMPTS[i]), ref["logits"][i]), f"trial {trial}: poisoned cache"
        tally("faults_injected_generation", injected)
        tally("faults_surfaced_as_IOFault", surfaced)
        tally("faults_absorbed_by_reread", absorbed)
        tally("prefetch_reads_failed", getattr(engine.store.stats, "prefetch_failed", 0) - prefetch_failed0)
    finally:
        engine.close()
    assert back_to_baseline(threads, fds)
    assert injected >= trials // 2, (injected, trials)  # most trials really hit a read
    assert surfaced >= injected // 2


def test_failed_requests_do_not_leak_cache_slots(checkpoint_factory, faulty_os):
    """Rule 7: a fault fails that request only. When a request fails, its other reads still land; their slots
    must become evictable again, or every failed request shrinks the cache until no request can run
    ("every slot is held by units not yet released"): the store settles such slots (Evictor.settle)."""
    path, ref = references(checkpoint_factory, "qwen3_moe")
    rng = random.Random(99)
    with Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off", prefetch=False) as engine:
        start = faulty_os.calls
        engine.logits([rng.randrange(1, 500) for _ in range(24)])
        calls = faulty_os.calls - start  # reads of one long prompt from a part-filled cache
        failed = 0
        for _ in range(20):  # long prompts: many reads queued at once when the fault hits, late layers included
            faulty_os.arm(rng.randint(calls // 3, calls), "eio", persistent=False)  # one read fails, others land
            try:
                engine.logits([rng.randrange(1, 500) for _ in range(24)])
            except IOFault:
                failed += 1
            faulty_os.disarm()
            settle_reads(engine)
        assert failed >= 10
        tally("faults_injected_generation", failed)
        tally("faults_surfaced_as_IOFault", failed)
        for i, prompt in enumerate(PROMPTS):
            assert torch.equal(engine.logits(prompt), ref["logits"][i])
        # the cache still has its capacity: one token's 16 experts (4 layers x top-4) fit in the 20 expert slots,
        # so asking twice reads nothing the second time
        engine.generate([7], max_new_tokens=1)
        again = engine.generate([7], max_new_tokens=1).stats
        assert again["misses"][engine.store.compute.name] == 0, (
            f"{again['misses']} misses on a repeated one-token request: cache slots whose reads landed after their "
            f"request failed can no longer be evicted")


# ---- I1 during load ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("direct_io", ["off", "on"])
def test_read_faults_while_loading(checkpoint_factory, faulty_os, direct_io):
    """Engine.open reads the pinned units: a fault there fails open() with a located IOFault, and leaves no reader
    thread, descriptor or ledger charge behind."""
    path, ref = references(checkpoint_factory, "qwen3_moe")
    rng = random.Random(7)
    threads, fds = threading.active_count(), open_fds()
    start = faulty_os.calls
    with Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, direct_io=direct_io) as engine:
        calls = faulty_os.calls - start
    assert calls > 3
    trials = max(4, int(40 * SCALE))
    for _ in range(trials):
        faulty_os.arm(rng.randint(1, calls), rng.choice(["eio", "eof"]), persistent=rng.random() < 0.5)
        with pytest.raises(IOFault) as err:
            Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, direct_io=direct_io)
        raised_at = time.monotonic()
        faulty_os.disarm()
        assert_located(err.value, faulty_os.injected, direct_io == "on")
        assert raised_at - faulty_os.injected[0].at < SURFACE_S
        assert back_to_baseline(threads, fds)
    tally("faults_injected_load", trials)
    tally("faults_surfaced_as_IOFault", trials)
    with Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, direct_io=direct_io) as engine:
        assert torch.equal(engine.logits(PROMPTS[0]), ref["logits"][0])


# ---- I4/D4: slow and short reads give the same tokens -----------------------------------------------------------

@pytest.mark.parametrize("config", CONFIGS[:3], ids=str)
def test_throttled_and_short_reads_give_identical_output(checkpoint_factory, faulty_os, config):
    path, ref = references(checkpoint_factory, config.arch)
    faulty_os.sleep_max, faulty_os.partial = 0.004, 0.3
    with config.open(path) as engine:
        assert engine.generate(PROMPTS[0], max_new_tokens=6, ignore_eos=True).token_ids == ref["tokens"]
        for i in (1, 3):
            assert torch.equal(engine.logits(PROMPTS[i]), ref["logits"][i])
    assert faulty_os.calls > 20
    tally("throttled_or_short_reads", faulty_os.calls)


# ---- I3: shard replaced, truncated or rewritten after open ------------------------------------------------------

@pytest.fixture
def model_copy(checkpoint_factory, tmp_path):
    src, ref = references(checkpoint_factory, "qwen3_moe")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst, ref


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def expect_changed(engine: Engine, prompt_index: int, times: int = 2) -> IOFault:
    for _ in range(times):  # every time, not once: the engine never serves what the index did not validate
        with pytest.raises(IOFault) as err:
            engine.logits(PROMPTS[prompt_index])
        msg = str(err.value)
        assert "shard changed on disk" in msg and ".safetensors" in msg and "offset" in msg, msg
        tally("faults_injected_file_changed")
        tally("faults_surfaced_as_IOFault")
    return err.value


@pytest.mark.parametrize("direct_io", ["off", "on"])
def test_shard_replaced_after_open_fails_every_read_until_restored(model_copy, direct_io):
    path, ref = model_copy
    threads, fds = threading.active_count(), open_fds()
    engine = Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io=direct_io)
    assert torch.equal(engine.logits(PROMPTS[0]), ref["logits"][0])  # descriptors of the shards are open now
    backups = []
    for shard in shards(path):  # os.replace: same bytes, new inode (a re-download, an rsync)
        backup = shard.with_suffix(".orig")
        os.replace(shard, backup)
        shutil.copyfile(backup, shard)
        backups.append((backup, shard))
    err = expect_changed(engine, 1)
    assert "replaced" in str(err)
    for backup, shard in backups:  # the validated files come back (same inode, size and mtime)
        os.replace(backup, shard)
    assert torch.equal(engine.logits(PROMPTS[1]), ref["logits"][1])
    engine.close()
    assert back_to_baseline(threads, fds)


@pytest.mark.parametrize("direct_io", ["off", "on"])
def test_shard_truncated_after_open_is_located_and_needs_a_reopen(model_copy, direct_io):
    path, ref = model_copy
    engine = Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io=direct_io)
    assert torch.equal(engine.logits(PROMPTS[0]), ref["logits"][0])
    originals = {s: s.read_bytes() for s in shards(path)}
    for s in originals:
        os.truncate(s, s.stat().st_size // 2)  # in place: same inode, the engine's descriptors see it
    err = expect_changed(engine, 1)
    assert "size" in str(err)
    for s, data in originals.items():  # rewritten with the right bytes: still not the file the index validated
        s.write_bytes(data)
    expect_changed(engine, 2, times=1)
    engine.close()
    with Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io=direct_io) as engine:
        assert torch.equal(engine.logits(PROMPTS[1]), ref["logits"][1])  # a re-open validates them again


@pytest.mark.parametrize("direct_io", ["off", "on"])
def test_shard_rewritten_in_place_same_size_is_detected(model_copy, direct_io):
    """The dangerous case: same inode, same size, different bytes. The mtime gives it away. (O_DIRECT: needs the
    store to pass its ShardFiles to open_direct / read_range_direct.)"""
    path, ref = model_copy
    with Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io=direct_io) as engine:
        assert torch.equal(engine.logits(PROMPTS[0]), ref["logits"][0])
        time.sleep(0.01)
        for s in shards(path):
            with open(s, "r+b") as f:
                f.seek(-4096, os.SEEK_END)
                f.write(b"\x7f" * 4096)
        err = expect_changed(engine, 1)
        assert "modified" in str(err)


def test_shard_deleted_after_open(model_copy):
    path, _ = model_copy
    with Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off") as engine:
        engine.logits(PROMPTS[0])
        for s in shards(path):
            s.unlink()
        with pytest.raises(IOFault) as err:
            engine.logits(PROMPTS[1])
        assert "disappeared" in str(err.value) and ".safetensors" in str(err.value)
        tally("faults_injected_file_changed")
        tally("faults_surfaced_as_IOFault")


# ---- I5: a read that never returns -------------------------------------------------------------------------------

STALL_S = 1.0


@pytest.fixture
def stall_timeout(monkeypatch):
    monkeypatch.setenv("OFFLOAD_ENGINE_STALL_TIMEOUT", str(STALL_S))
    return STALL_S


def generate_expecting_stall(engine: Engine, fos: FaultyOS | None = None) -> BaseException:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        engine.logits(PROMPTS[1])
    elapsed = time.monotonic() - start
    assert elapsed < SURFACE_S + STALL_S, elapsed  # the watchdog fires, nothing waits for the default 60 s
    if fos is not None and fos.injected:
        assert time.monotonic() - fos.injected[0].at < SURFACE_S + 0.5
    tally("faults_injected_stall")
    return err.value


@pytest.mark.parametrize("prefetch", [False, True])
def test_stuck_read_times_out_naming_file_and_offset_then_recovers(checkpoint_factory, faulty_os, stall_timeout,
                                                                   prefetch):
    path, ref = references(checkpoint_factory, "qwen3_moe")
    threads, fds = threading.active_count(), open_fds()
    engine = Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off", prefetch=prefetch)
    engine.logits(PROMPTS[0])
    faulty_os.arm(1, "stall")
    err = generate_expecting_stall(engine, faulty_os)
    msg = str(err)
    assert "stalled" in msg and ".safetensors" in msg and "offset" in msg, msg
    assert any(i.path in msg and f"offset {i.offset}" in msg for i in faulty_os.injected), (msg, faulty_os.injected)
    tally("faults_surfaced_as_IOFault" if isinstance(err, IOFault) else "stalls_surfaced_as_TimeoutError")
    faulty_os.disarm()  # the disk answers again: the stuck reads land, and the engine serves normally
    assert torch.equal(engine.logits(PROMPTS[1]), ref["logits"][1])
    assert torch.equal(engine.logits(PROMPTS[2]), ref["logits"][2])
    engine.close()
    assert back_to_baseline(threads, fds)


def test_stall_error_is_a_located_engine_error(checkpoint_factory, faulty_os, stall_timeout):
    """RELIABILITY rule 2: typed and located: errors.IOStallError (an IOFault and a TimeoutError), raised by the
    store's watchdog (ReaderPool.wait_any / stall_error); a builtin TimeoutError fails here."""
    path, _ = references(checkpoint_factory, "qwen3_moe")
    with Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off", prefetch=False) as engine:
        engine.logits(PROMPTS[0])
        faulty_os.arm(1, "stall")
        err = generate_expecting_stall(engine, faulty_os)
        faulty_os.disarm()
    assert isinstance(err, IOFault), f"stall surfaced as {type(err).__name__}, not an engine IOFault: {err}"
    assert os.path.realpath(err.path) in {i.path for i in faulty_os.injected}
    assert err.offset in {i.offset for i in faulty_os.injected}


def test_read_inherited_from_an_aborted_request_is_retried_not_reported(checkpoint_factory, faulty_os,
                                                                        stall_timeout):
    """Request 1 gives up on reads stuck in a failing disk. The disk heals; request 2 needs the same units and
    finds those old reads still in flight, and they then fail. Request 2 must read the units again itself rather
    than fail with request 1's fault (the store already does so when the old read failed before request 2
    looked; the outcome must not depend on that timing)."""
    path, ref = references(checkpoint_factory, "qwen3_moe")
    engine = Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off", prefetch=False)
    try:
        engine.logits(PROMPTS[0])
        faulty_os.arm(1, "stall-then-eio")
        generate_expecting_stall(engine, faulty_os)
        faulty_os.heal()  # new reads succeed; the stuck ones fail with EIO when released
        timer = threading.Timer(0.3, faulty_os.release.set)
        timer.start()
        try:
            out = engine.logits(PROMPTS[1])
        except IOFault as e:
            pytest.fail(f"request 2 failed with a fault of a read request 1 started: {e}")
        finally:
            timer.join()
        assert torch.equal(out, ref["logits"][1])
    finally:
        faulty_os.disarm()
        engine.close()


def test_close_with_a_read_stuck_forever_returns_and_reports_it(checkpoint_factory, faulty_os, stall_timeout):
    path, _ = references(checkpoint_factory, "qwen3_moe")
    threads, fds = threading.active_count(), open_fds()
    engine = Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off", prefetch=False)
    engine.logits(PROMPTS[0])
    faulty_os.arm(1, "stall")
    generate_expecting_stall(engine, faulty_os)
    pool = engine.store.pool
    start = time.monotonic()
    engine.close()  # cannot join a thread inside a read that never returns: bounded wait, then report it
    assert time.monotonic() - start < 2.0
    assert pool.unjoined, "a reader thread is stuck, close() must say so"
    assert all(".safetensors" in u and "offset" in u for u in pool.unjoined), pool.unjoined
    engine.close()  # idempotent
    with pytest.raises(OffloadEngineError, match="closed"):
        engine.logits(PROMPTS[0])
    faulty_os.disarm()  # the read returns: the leftover daemon threads exit
    assert back_to_baseline(threads, fds)


def test_stuck_read_while_loading(checkpoint_factory, faulty_os, stall_timeout):
    path, _ = references(checkpoint_factory, "qwen3_moe")
    threads, fds = threading.active_count(), open_fds()
    faulty_os.arm(3, "stall")
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, direct_io="off")
    assert time.monotonic() - start < SURFACE_S + STALL_S + 1.0  # stall timeout, then a bounded close
    assert ".safetensors" in str(err.value) and "offset" in str(err.value), str(err.value)
    tally("faults_injected_stall")
    faulty_os.disarm()
    assert back_to_baseline(threads, fds)


class BlockingReader:
    """A reader (the read_fn interface) that blocks before it reaches the disk: a hung network filesystem client,
    a FUSE daemon that stopped answering."""

    def __init__(self):
        self.armed = False
        self.release = threading.Event()

    def __call__(self, files, r, blob):
        if self.armed:
            self.release.wait()
        read_range(files, r, blob)


def test_stuck_reader_interface_is_named_by_file_and_offset(checkpoint_factory, stall_timeout):
    """The store records the range around its read function (readers.reading): without it the stall report
    could only name the unit."""
    path, ref = references(checkpoint_factory, "qwen3_moe")
    reader = BlockingReader()
    engine = Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off", prefetch=False,
                         read_fn=reader)
    try:
        engine.logits(PROMPTS[0])
        reader.armed = True
        err = generate_expecting_stall(engine)
        reader.armed = False
        reader.release.set()
        assert torch.equal(engine.logits(PROMPTS[1]), ref["logits"][1])
        assert ".safetensors" in str(err) and "offset" in str(err), f"stall report does not locate the read: {err}"
    finally:
        reader.release.set()
        engine.close()


def test_watchdog_measures_progress_not_duration():
    """A read slower than the stall timeout in total, whose system calls keep returning, is not a stall (a large
    unit on a slow disk); a read stuck in one call is, and the error names its file and offset."""
    pool = ReaderPool(2)
    release = threading.Event()

    def slow_but_moving():
        for k in range(8):  # 8 calls of 0.1 s: 0.8 s in all, twice the timeout
            with reading("/data/model-00001.safetensors", 4096 * k, 4096):
                time.sleep(0.1)
        return "done"

    def stuck():
        with reading("/data/model-00002.safetensors", 123456, 4096):
            release.wait()

    try:
        fut = pool.submit(0, slow_but_moving, "expert 0/1")
        done = set()
        while fut not in done:
            done = pool.wait_any([fut], timeout=0.4, waited_for=["expert 0/1"])
        assert fut.result() == "done"
        blocked = pool.submit(0, stuck, "expert 0/2")
        start = time.monotonic()
        with pytest.raises(IOStallError) as err:
            pool.wait_any([blocked], timeout=0.4, waited_for=["expert 0/2"])
        assert 0.4 <= time.monotonic() - start < 0.4 + SURFACE_S
        assert err.value.path == "/data/model-00002.safetensors" and err.value.offset == 123456, str(err.value)
        assert isinstance(err.value, TimeoutError) and isinstance(err.value, IOFault)
        tally("faults_injected_stall")
        tally("faults_surfaced_as_IOFault")
    finally:
        release.set()
        assert not pool.close()


# ---- I6: a reader raising something unexpected ---------------------------------------------------------------

def test_unexpected_reader_exception_is_propagated_not_swallowed(checkpoint_factory):
    path, ref = references(checkpoint_factory, "qwen3_moe")
    state = {"boom": False}

    def buggy(files, r, blob):
        if state["boom"]:
            raise ValueError(f"reader bug at {r.file}:{r.file_offset}")
        read_range(files, r, blob)

    threads = threading.active_count()
    with Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off", read_fn=buggy) as engine:
        engine.logits(PROMPTS[0])
        state["boom"] = True
        with pytest.raises(ValueError, match="reader bug"):
            engine.logits(PROMPTS[1])
        state["boom"] = False
        assert torch.equal(engine.logits(PROMPTS[1]), ref["logits"][1])
    assert back_to_baseline(threads, 10**9)
