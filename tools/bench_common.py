"""What tools/bench.py and its peer and report modules share: the results' records, MB, and the measuring helpers
(waiting for a quiet machine, evicting files from the page cache, settling freed memory, prompt ids)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from offload_engine.probe import cpu_busy_s

MB = 1e6

# ---- results ------------------------------------------------------------------------------------------------
@dataclass
class EngineRun:
    budget_pct: float | None  # None: no budget (every unit pinned): the resident compute reference
    tokens: list[int]  # prefill's token, then one per decode step
    decode_steps: int
    decode_s: float
    s_per_token: float
    tok_s: float
    bytes_read_disk_per_token: float  # store counter, decode steps only
    needed_bytes_per_token: float  # read and then used: minus prefetches evicted unused (the bound's bytes)
    os_read_bytes_per_token: float | None  # /proc/self/io read_bytes: what really came from storage
    hit_rate: float  # compute-tier hits / acquisitions, decode steps only
    stall_s_per_token: float  # time the compute thread waited for reads
    cpu_util: float  # process CPU seconds / wall seconds during decode (2 cores -> at most 2.0)
    others_cpu: float  # cores used by other processes during decode (a shared machine's noise)
    peak_bytes: dict[str, int | None]
    budget_bytes: dict[str, int | None]
    direct_io: bool
    open_s: float
    prefetch: dict[str, Any] = field(default_factory=dict)
    bytes_host_to_device_per_token: float = 0.0  # store counter, decode steps only (0 without a device tier)
    prefetch_mode: str = "adaptive"
    wasted_bytes_per_token: float = 0.0  # prefetched and evicted unused
    io_overlap: float = 1.0  # share of the readers' busy time the compute thread did not wait through
    read_bytes_per_busy_s: float | None = None  # bytes read / time the readers had a read in flight, decode only:
    # what the disk delivered to the engine during this run (None: nothing read)


@dataclass
class PeerRun:
    budget_pct: float
    page_cache: str  # "bypass": its files evicted before every token; "allow": left in the page cache
    tokens: list[int]
    decode_steps: int
    decode_s: float
    s_per_token: float
    tok_s: float
    os_read_bytes_per_token: float | None
    cpu_util: float
    others_cpu: float
    bytes_on_disk: int  # parameters accelerate offloaded to disk: read again on every forward
    bytes_in_ram: int
    load_s: float


@dataclass
class Row:
    budget_pct: float
    engine: EngineRun
    peers: dict[str, PeerRun]
    resident_s_per_token: float  # the mean of the runs right before and right after this budget's engine runs
    resident_around: tuple[float, float]  # those two runs' s/token
    disk_bw: float  # O_DIRECT bytes/s the bound uses: sampled right before and right after this budget's runs
    disk_around: tuple[float, float]  # those two samples (the faster of the probe's two read patterns each)
    bound_s_per_token: float
    engine_vs_bound: float
    tokens_match: dict[str, bool]
    rounds_vs_bound: list[float] = field(default_factory=list)  # every round's engine / bound (--rounds); the
    # row's engine run, resident_around and engine_vs_bound are those of the median round
    median_round: int = 0  # its index
    physical: dict[str, float] = field(default_factory=dict)  # tools/bench_physical.PhysicalBound of the row's
    # engine run: active bytes / memory bandwidth, bytes read and used / O_DIRECT bandwidth, their max, the ratio

    def ratio(self, mode: str) -> float | None:
        peer = self.peers.get(mode)
        return self.engine.tok_s / peer.tok_s if peer and peer.tok_s else None


# ---- measuring helpers --------------------------------------------------------------------------------------
def wait_for_quiet(max_wait: float, cores: float = 0.3) -> float:
    """Wait (at most max_wait s) until other processes use fewer than `cores` over a 1 s sample; returns the
    seconds waited. A shared machine's neighbours otherwise decide the figures."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait:
        busy, cpu = cpu_busy_s(), time.process_time()
        time.sleep(1.0)
        if (cpu_busy_s() - busy) - (time.process_time() - cpu) < cores:
            break
    return time.perf_counter() - start


# A virtual machine with free page reporting (virtio-balloon) hands memory the guest frees back to its host a
# couple of seconds later, and on this project's VM the host's work on it stalls the virtual disk: after the
# resident engine (2.6 GB) closed, the next engine's decode reads took up to 60-110 ms each and its wait was
# 10-23 ms/token, against 2.6-5.8 (max read 5-34 ms) with the freed memory reported first (tools/bench.py's own
# sequence, 3 rounds each; the reporting interrupts fell from 6 to 2 per measured request). So after closing a
# model, the bench waits for the reporting to finish before it measures the next one.
REPORTING_DELAY_S = 2.5  # the kernel reports free pages 2 s after they are freed (page_reporting_delay)
SETTLE_MIN_BYTES = 256 << 20  # a smaller free (the --quick checkpoint's) is not waited for


def reporting_interrupts() -> int | None:
    """Free page reporting requests served so far (virtio-balloon's "reporting" interrupts), or None."""
    try:
        with open("/proc/interrupts") as f:
            line = next((line for line in f if "reporting" in line), None)
    except OSError:
        return None
    if line is None:
        return None
    return sum(int(v) for v in line.split()[1:] if v.isdigit())


def settle_freed_memory(rss_before: int, max_wait: float = 15.0, quiet: float = 1.0) -> float:
    """After a model's memory was freed (the process's RSS was `rss_before`): wait until the VM has reported it to
    its host (no reporting interrupt for `quiet` s, at least REPORTING_DELAY_S after the call, at most
    `max_wait`); returns the seconds waited. Returns at once where the VM does not report free pages or less
    than SETTLE_MIN_BYTES were freed."""
    if reporting_interrupts() is None or rss_before - psutil.Process().memory_info().rss < SETTLE_MIN_BYTES:
        return 0.0
    start = time.perf_counter()
    time.sleep(REPORTING_DELAY_S)
    last = reporting_interrupts()
    while time.perf_counter() - start < max_wait:
        time.sleep(quiet)
        now = reporting_interrupts()
        if now == last:
            break
        last = now
    return time.perf_counter() - start


def evict(paths: list[Path], sync: bool = False) -> None:
    """Drop these files' pages from the page cache (their next read comes from the disk). DONTNEED skips dirty
    pages, so files just written (accelerate's offload folder) need sync=True once."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            if sync:
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prompt_ids(n: int, vocab: int, salt: int = 0) -> list[int]:
    """Deterministic ids away from the special tokens at the start of the vocabulary."""
    return [(i * 7919 + 101 + salt * 31) % (vocab - 3) + 3 for i in range(n)]


def label(pct: float | None) -> str:
    """A budget's name in tables and logs."""
    return "resident" if pct is None else f"{pct:g}%"
