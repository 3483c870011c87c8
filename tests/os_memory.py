"""What the OS says a run costs in memory, for the budget tests (issue 45 item 7): the process's peak resident
growth over a baseline taken before the engine opens, plus the pages of the checkpoint the page cache holds.

The engine's ledger counts what the engine charged; these figures count what the kernel gave:

  - peak RSS: /proc/self/status VmHWM, reset to the current RSS (/proc/self/clear_refs "5") right after the
    baseline, so the peak is the run's own and not the imports' or a warm-up's. It counts every page the process
    touched: slots, staging, KV cache, activations, the allocator's slack.
  - the page cache: the checkpoint's files are evicted (POSIX_FADV_DONTNEED) before the run, and a sampler counts
    their cached pages (mincore over a read-only mapping) through it: a buffered read leaves its pages cached,
    which RSS does not show, and they are memory the run took from the machine all the same.

A budget holds when their sum (a sum of two peaks: never below the peak of the sum) is within the budget plus
`slack`. `measure` runs each measurement in a forked child of one fresh interpreter that imported everything
and ran a warm-up first, so memory other tests of the same worker hold, and one-time costs, are not in it.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from tools.page_cache import cached_bytes

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def slack(budget: int) -> int:
    """What a process may take beyond its budget: 10% of it or 16 MiB, whichever is larger (the interpreter's
    own allocations while it runs: activations, the tokenizer, the allocator's rounding, reads in flight)."""
    return max(budget // 10, 16 * MiB)


# ---- the page cache: tools/page_cache.py ------------------------------------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)  # malloc_trim (trim)


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache: the run starts cold. Synced first: DONTNEED skips dirty
    pages, and a checkpoint the session has just written would stay cached (and count) until written back."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def shards(model: Path | str) -> list[Path]:
    """A checkpoint folder's weight files."""
    return sorted(Path(model).glob("*.safetensors")) or sorted(Path(model).glob("*.gguf"))


class CacheSampler:
    """The largest cached_bytes(paths) seen between entering and leaving, sampled every `every` seconds."""

    def __init__(self, paths: list[Path], every: float = 0.005):
        self.paths, self.every, self.peak = paths, every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, cached_bytes(self.paths))
            if self._done.wait(self.every):
                break

    def __enter__(self) -> "CacheSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, cached_bytes(self.paths))


# ---- the process -----------------------------------------------------------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss() -> int:
    return _status("VmRSS")


def trim(collect: bool = True) -> None:
    """Freed memory back to the OS before a baseline (glibc keeps freed heap otherwise); collect: unreachable
    cycles first (a full collection: ~0.3 s with torch imported)."""
    if collect:
        gc.collect()
    if hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


@dataclass
class Growth:
    """What a measured span took: the peak RSS over its baseline and the peak of the watched files' cached
    bytes (filled in when the span ends)."""
    rss: int = 0
    cache: int = 0
    file: int = 0  # of `rss`, file-backed pages newly mapped (shared libraries' code a fresh path runs)

    @property
    def total(self) -> int:
        return self.rss + self.cache


@contextlib.contextmanager
def measured(paths: list[Path], every: float = 0.005, collect: bool = True) -> Iterator[Growth]:
    """Measure the span: `paths` evicted first, the baseline RSS taken and the peak reset, then the span's peak
    RSS growth and the peak of the files' cached bytes. In a test's own process the baseline holds what earlier
    tests left; memory they freed and this span reuses is not counted (see `measure` for a clean process), so
    there the figures can only be low, and the full garbage collection before the baseline (`trim`) can go."""
    evict(paths)
    trim(collect)
    base = rss()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM back to the current RSS (Linux >= 4.0)
        f.write("5")
    growth, file_base = Growth(), _status("RssFile")
    with CacheSampler(paths, every) as cache:
        yield growth
    growth.rss, growth.cache = _status("VmHWM") - base, cache.peak
    growth.file = _status("RssFile") - file_base


# ---- measurements in a clean process -----------------------------------------------------------------------------
def engine_run(spec: dict) -> dict:
    """spec: model, open (Engine.open keywords; "ram"/"vram" go to the Budget), prompt (ids), tokens. Returns the
    OS's figures and the engine's own (ledger peaks and budgets per tier, disk reads, direct I/O)."""
    from offload_engine import Budget, Engine

    kw = dict(spec.get("open", {}))
    budget = Budget(**{k: kw.pop(k) for k in ("ram", "vram") if k in kw})
    with measured(shards(spec["model"])) as growth:
        with Engine.open(spec["model"], budget=budget, **kw) as engine:
            stats = engine.generate(spec["prompt"], max_new_tokens=spec["tokens"], ignore_eos=True).stats
            ledger, store = engine.store.ledger, engine.store
    return {"rss": growth.rss, "cache": growth.cache, "total": growth.total, "file": growth.file,
            "ledger_peak": ledger.peak(),
            "budgets": ledger.budgets(), "bytes_read_disk": stats["bytes_read_disk"], "direct_io": store.direct_io,
            "keep_cache": store.io.keep_cache, "model_bytes": sum(f.stat().st_size for f in shards(spec["model"]))}


def cli_run(spec: dict) -> dict:
    """spec: argv (offload_engine.cli.main's), watch (files whose cached pages count). Returns rc and figures."""
    from offload_engine.cli import main

    with measured([Path(p) for p in spec["watch"]]) as growth, contextlib.redirect_stdout(io.StringIO()):
        rc = main(spec["argv"])
    return {"rc": rc, "rss": growth.rss, "cache": growth.cache, "total": growth.total, "file": growth.file}


RUNS: dict[str, Callable[[dict], dict]] = {"engine": engine_run, "cli": cli_run}


def _forked(spec: dict) -> dict:
    """The run `spec` measured in a forked child, so every measurement starts from the same warmed-up parent.
    The child first runs spec["warmup"] (the same run on a small checkpoint): a forked child maps the shared
    libraries' pages lazily, and the code a run executes would otherwise count as its growth (27 MB of
    libtorch's pages at the first open, measured), though those pages are the parent's, not new memory."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without the interpreter's teardown
        os.close(r)
        try:
            if spec.get("warmup"):
                RUNS[spec["kind"]](spec["warmup"])
            out = {"ok": RUNS[spec["kind"]](spec)}
        except BaseException:
            out = {"error": traceback.format_exc()}
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(out))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data) if data else {"error": "the measuring child died without a report"}
    if "error" in out:
        raise RuntimeError(out["error"])
    return out["ok"]


def main(request: dict) -> list[dict]:
    """request: warmup (runs done in this process before any measurement: imports, kernels, lazily built
    state), runs (each measured in its own forked child, after its own warm-up: `_forked`). A run:
    {"kind": "engine" | "cli", "warmup": a run of the same kind or None, ...its spec}."""
    import torch

    torch.set_num_threads(1)
    for spec in request.get("warmup", []):
        RUNS[spec["kind"]](spec)
    trim()
    return [_forked(spec) for spec in request["runs"]]


def measure(runs: list[dict], warmup: list[dict] = (), timeout: float = 300) -> list[dict]:
    """Each run measured in a clean process (see `main`): one fresh interpreter, one torch thread, the CPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "OFFLOAD_ENGINE_DEVICE": "cpu"}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:  # the request may be longer than argv allows
        json.dump({"warmup": list(warmup), "runs": runs}, f, default=str)
        f.flush()
        out = subprocess.run([sys.executable, "-m", "tests.os_memory", f.name], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))))
