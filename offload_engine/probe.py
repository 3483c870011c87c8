"""Hardware measurements: disk read bandwidth (page cache bypassed), memory copy bandwidth, matmul throughput,
and on CUDA the host -> device copy bandwidth and GPU matmul throughput.

Pure measurement: each function runs one small experiment and returns a frozen dataclass with the figure and
how it was obtained, so a report can say what was measured. Nothing here plans or changes settings. The last
section reads process and machine counters (storage reads, CPU busy time) so a benchmark can say what else was
competing for the machine while it measured.
"""
from __future__ import annotations

import mmap
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from .constants import PAGE
from .interrupts import deliver_pending

MiB = 1 << 20


@dataclass(frozen=True)
class Bandwidth:
    """bytes_per_s = nbytes / seconds (of the median run when there were several repeats)."""

    bytes_per_s: float
    nbytes: int
    seconds: float
    method: str  # e.g. "O_DIRECT", "buffered + POSIX_FADV_DONTNEED", "torch copy_", "pinned H2D"
    block: int = 0  # bytes per request (disk) or per copy
    threads: int = 1
    source: str = ""  # file or device measured

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Throughput:
    """flops_per_s = 2 n^3 / seconds for an n x n matmul (best of `repeats`)."""

    flops_per_s: float
    n: int
    seconds: float
    dtype: str
    device: str
    threads: int
    method: str = "torch.matmul"

    def to_dict(self) -> dict:
        return asdict(self)


# ---- disk ---------------------------------------------------------------------------------------------------
def open_direct(path: Path) -> int | None:
    """An O_DIRECT descriptor of `path`, or None where the system or filesystem refuses one."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:  # tmpfs and some overlays refuse O_DIRECT at open
        return None


def _drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _read_blocks(fd: int, offsets: list[int], block: int, end: int) -> int:
    """Read `block` bytes at each offset into one page-aligned buffer (anonymous mmap); returns bytes read."""
    buf = memoryview(mmap.mmap(-1, block))
    done = 0
    try:
        for off in offsets:
            want = min(block, -(-(end - off) // PAGE) * PAGE)  # the tail stays aligned: O_DIRECT may over-read
            done += min(os.preadv(fd, [buf[:want]], off), end - off)
    finally:
        buf.release()
    return done


def _timed_parallel_read(fd: int, nbytes: int, block: int, threads: int) -> tuple[int, float]:
    """Thread i reads blocks i, i+T, i+2T... (like a pool of readers issuing independent requests)."""
    offsets = list(range(0, nbytes, block))
    shares = [offsets[i::threads] for i in range(threads)]
    results = [0] * threads
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = _read_blocks(fd, shares[i], block, nbytes)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        while t.is_alive():  # bounded waits, so that a Ctrl-C deferred inside threading's code lands promptly
            t.join(0.1)
            deliver_pending()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sum(results), seconds


def measure_direct_read_bandwidth(path: str | os.PathLike, nbytes: int = 1 << 30, block: int = 8 * MiB,
                                  threads: int = 1, repeats: int = 1,
                                  opener: Callable[[Path], int | None] = open_direct) -> Bandwidth:
    """Sequential read of the first `nbytes` of `path` (capped at its size) bypassing the page cache.

    O_DIRECT into page-aligned buffers where the filesystem allows it; otherwise buffered reads after
    POSIX_FADV_DONTNEED on the whole file (so the pages are not already cached), and again afterwards so the
    measurement leaves nothing behind (`opener` returning None takes that path). The method used is in the result. With repeats > 1 the median run is
    returned: virtual disks vary a lot from one pass to the next, and the median is what reads can sustain."""
    path = Path(path)
    if block % PAGE:
        raise ValueError(f"block must be a multiple of {PAGE} bytes, got {block}")
    nbytes = min(nbytes, path.stat().st_size)
    if nbytes <= 0:
        raise ValueError(f"{path}: empty file, nothing to measure")
    runs: list[tuple[int, float]] = []
    method = "O_DIRECT"
    for _ in range(max(1, repeats)):
        fd = opener(path)
        try:
            if fd is not None:
                try:
                    result = _timed_parallel_read(fd, nbytes, block, threads)
                except OSError:  # opened, but reads refused (EINVAL on some filesystems): fall back below
                    os.close(fd)
                    fd = None
            if fd is None:
                method = "buffered + POSIX_FADV_DONTNEED"
                fd = os.open(path, os.O_RDONLY)
                _drop_cache(fd)
                result = _timed_parallel_read(fd, nbytes, block, threads)
                _drop_cache(fd)
        finally:
            if fd is not None:
                os.close(fd)
        runs.append(result)
    runs.sort(key=lambda r: r[0] / r[1])
    done, seconds = runs[len(runs) // 2]
    return Bandwidth(done / seconds, done, seconds, method, block, threads, str(path))


# ---- memory and compute (CPU) -------------------------------------------------------------------------------
def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports for cpu0 (sysfs), or None where it reports none. A bandwidth probe's
    working set must be several times this or it times the cache, not RAM (servers carry 100+ MiB of L3)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes) if sizes else None


def measure_memcpy_bandwidth(nbytes: int = 256 * MiB, repeats: int = 5) -> Bandwidth:
    """Bytes copied per second by one large torch copy_ between two RAM buffers (each byte is read once and
    written once, so memory traffic is twice the figure). The first copy warms the pages and is not timed."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = best_time(lambda: dst.copy_(src), repeats)
    return Bandwidth(nbytes / seconds, nbytes, seconds, "torch copy_ (RAM -> RAM)", nbytes, torch.get_num_threads(),
                     "cpu")


def measure_cpu_gemv_bandwidth(dtype: torch.dtype = torch.float32, nbytes: int | None = None,
                               repeats: int = 5) -> Bandwidth:
    """Weight bytes per second one-token matmuls (GEMV, decode's shape) read on the CPU, cycling 4096 x 1024
    matrices through `nbytes` (default: 4x the last-level cache, 256 MiB to 1 GiB: a server's L3 holds 100+ MiB,
    and a probe that fits in it times the cache, not RAM). One allocation, so it goes back to the OS when freed
    (glibc serves blocks under 32 MiB from its heap, which keeps them: the process would grow by the probe)."""
    nbytes = nbytes or min(max(256 * MiB, 4 * (last_level_cache_bytes() or 0)), 1 << 30)
    rows, cols = 4096, 1024
    size = torch.finfo(dtype).bits // 8 * rows * cols
    count = max(1, nbytes // size)
    ws = torch.full((count, rows, cols), 0.5, dtype=dtype)
    x = torch.randn(1, cols, dtype=dtype)

    def gemvs():
        for w in ws:
            torch.nn.functional.linear(x, w)

    gemvs()  # warm-up: first calls pick kernels
    seconds = best_time(gemvs, repeats)
    return Bandwidth(count * size / seconds, count * size, seconds, f"torch linear, 1 x {cols} by {rows} x {cols}",
                     size, torch.get_num_threads(), "cpu")


def measure_cpu_matmul_flops(n: int = 1024, dtype: torch.dtype = torch.float32, repeats: int = 5) -> Throughput:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)  # warm-up: first call picks kernels and touches the output
    seconds = best_time(lambda: torch.matmul(a, b), repeats)
    return Throughput(2 * n ** 3 / seconds, n, seconds, str(dtype).replace("torch.", ""), "cpu",
                      torch.get_num_threads())


# ---- CUDA ---------------------------------------------------------------------------------------------------
def _cuda_time(fn, repeats: int, device: torch.device) -> float:
    """Best time of fn() in seconds, measured with CUDA events on the current stream (no host-side skew)."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measure_h2d_bandwidth(nbytes: int = 256 * MiB, pinned: bool = True, repeats: int = 5,
                          device: str | torch.device = "cuda") -> Bandwidth | None:
    """Host -> device copy bandwidth (pinned host memory by default: pageable runs at a fraction). None without
    CUDA."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    with torch.cuda.device(dev):
        host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst.copy_(host, non_blocking=pinned)  # warm-up
        torch.cuda.synchronize(dev)
        seconds = _cuda_time(lambda: dst.copy_(host, non_blocking=pinned), repeats, dev)
    method = "pinned H2D copy_" if pinned else "pageable H2D copy_"
    return Bandwidth(nbytes / seconds, nbytes, seconds, method, nbytes, 1, str(dev))


def measure_gpu_matmul_flops(n: int = 8192, dtype: torch.dtype = torch.bfloat16, repeats: int = 5,
                             device: str | torch.device = "cuda") -> Throughput | None:
    if not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    with torch.cuda.device(dev):
        a = torch.randn(n, n, dtype=dtype, device=dev)
        b = torch.randn(n, n, dtype=dtype, device=dev)
        torch.matmul(a, b)
        torch.cuda.synchronize(dev)
        seconds = _cuda_time(lambda: torch.matmul(a, b), repeats, dev)
    return Throughput(2 * n ** 3 / seconds, n, seconds, str(dtype).replace("torch.", ""), str(dev), 1)


# ---- process and machine counters ------------------------------------------------------------------------------
def os_read_bytes() -> int | None:
    """Bytes this process (all threads) fetched from storage; page-cache hits are not counted."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return None


def cpu_busy_s() -> float:
    """Machine-wide busy CPU seconds since boot (all processes), from /proc/stat; 0.0 where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass
class Meter:
    """Wall time, this process's CPU time, the machine's busy CPU time and storage reads between start() and
    stop(), summed over intervals. On a shared machine `others_cpu` says how much other processes competed."""

    wall: float = 0.0
    cpu: float = 0.0
    busy: float = 0.0
    read: int | None = 0
    _t: tuple = ()

    def start(self) -> None:
        self._t = (time.perf_counter(), time.process_time(), cpu_busy_s(), os_read_bytes())

    def stop(self) -> None:
        wall, cpu, busy, read = self._t
        self.wall += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu
        self.busy += cpu_busy_s() - busy
        now = os_read_bytes()
        self.read = None if self.read is None or now is None or read is None else self.read + now - read

    def per(self, n: int) -> float | None:
        return None if self.read is None else self.read / max(n, 1)

    @property
    def cpu_util(self) -> float:
        return self.cpu / self.wall if self.wall else 0.0

    @property
    def others_cpu(self) -> float:
        """Cores used by other processes on average (negative noise clipped: /proc/stat counts in ticks)."""
        return max(0.0, self.busy - self.cpu) / self.wall if self.wall else 0.0


def machine_info() -> dict[str, Any]:
    """What a benchmark report needs to name the machine (loadavg: now, 1/5/15 min)."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": cpu or platform.processor(), "torch_threads": torch.get_num_threads(),
            "ram_bytes": psutil.virtual_memory().total, "platform": platform.platform(),
            "loadavg": os.getloadavg(), "python": platform.python_version()}
