"""Hardware profiles: the bandwidths and throughputs the cost model needs, loaded by name or file, or probed.

A profile is plain data (configs/hardware/NAME.json). Bandwidths are in GB/s (1e9 bytes/s) as *achieved*
figures (what a copy or a kernel really gets), not datasheet peaks; every field's origin is noted in `sources`.
`probe()` measures this machine: O_DIRECT reads from a scratch file, RAM copies, CPU batch-1 matmul (GEMV)
bandwidth and GEMM FLOPs, the per-op dispatch latency, and with CUDA the host->device copy, device GEMV
bandwidth and bf16 GEMM throughput.
"""
from __future__ import annotations

import json
import mmap
import os
import platform
import threading
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError
from ..units import format_bytes, parse_bytes

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
_SIZE_FIELDS = ("vram_bytes", "ram_bytes")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    vram_bytes: int  # 0: no GPU (the compute tier is then a budgeted pool in RAM)
    ram_bytes: int
    gpu_mem_gbps: float  # device memory bandwidth achieved by a batch-1 matmul (weights read once)
    gpu_tflops: float  # dense bf16 matmul throughput
    pcie_gbps: float  # host -> device copy from pinned memory
    ram_gbps: float  # RAM -> RAM copy (bytes copied per second): host -> compute-pool copies on a CPU engine
    cpu_gemv_gbps: float  # weight bytes per second a CPU batch-1 matmul streams (all cores)
    cpu_gflops: float  # CPU GEMM throughput (compute dtype of CPU experts)
    nvme_gbps: float  # O_DIRECT reads of unit-sized requests, 4 reader threads
    nvme_latency_us: float = 100.0  # one read's fixed cost
    gpu_op_us: float = 8.0  # one eager torch op on the GPU (launch + Python dispatch)
    cpu_op_us: float = 6.0  # one small torch op on the CPU (Python dispatch)
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def has_gpu(self) -> bool:
        return self.vram_bytes > 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "profile") -> "HardwareProfile":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(names)}")
        values = dict(data)
        for key in _SIZE_FIELDS:
            if key in values:
                try:
                    values[key] = parse_bytes(values[key], what=f"{where}: {key}")
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        required = [f.name for f in fields(cls) if f.name not in values and _no_default(f)]
        if required:
            raise ConfigError(f"{where}: missing field(s) {required}")
        for f in fields(cls):
            if f.name in values and f.name not in ("name", "description", "sources") + _SIZE_FIELDS:
                v = values[f.name]
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                    raise ConfigError(f"{where}: {f.name} must be a number >= 0, found {v!r}")
        if values.get("vram_bytes") and not values.get("gpu_mem_gbps"):
            raise ConfigError(f"{where}: a GPU profile (vram_bytes > 0) needs gpu_mem_gbps > 0")
        for key in ("cpu_gemv_gbps", "nvme_gbps", "ram_gbps"):
            if not values.get(key):
                raise ConfigError(f"{where}: {key} must be > 0")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["vram_bytes"] = _gib(self.vram_bytes)
        d["ram_bytes"] = _gib(self.ram_bytes)
        d["sources"] = dict(self.sources)
        return d

    def with_changes(self, **changes: Any) -> "HardwareProfile":
        return HardwareProfile(**{**asdict(self), **changes})

    def describe(self) -> str:
        gpu = (f"GPU {format_bytes(self.vram_bytes)} at {self.gpu_mem_gbps:g} GB/s, {self.gpu_tflops:g} TFLOPS, "
               f"PCIe {self.pcie_gbps:g} GB/s; " if self.has_gpu else "no GPU; ")
        return (f"{self.name}: {gpu}RAM {format_bytes(self.ram_bytes)} (copy {self.ram_gbps:g} GB/s, CPU GEMV "
                f"{self.cpu_gemv_gbps:g} GB/s, {self.cpu_gflops:g} GFLOPS); NVMe {self.nvme_gbps:g} GB/s")


def _no_default(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _gib(n: int) -> str | int:
    return f"{n / 2**30:g}GiB" if n % 2**20 == 0 else n


def list_profiles() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


def load_profile(name_or_file: str | os.PathLike) -> HardwareProfile:
    """A profile by NAME (configs/hardware/NAME.json, case-insensitive) or by path to a JSON file."""
    path = Path(name_or_file)
    if not path.is_file():
        wanted = str(name_or_file).lower().removesuffix(".json")
        matches = [p for p in HARDWARE_DIR.glob("*.json") if p.stem.lower() == wanted]
        if not matches:
            raise ConfigError(f"--hardware {name_or_file!r}: no such file and no profile of that name; "
                              f"profiles: {', '.join(list_profiles()) or 'none'} (in {HARDWARE_DIR})")
        path = matches[0]
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read hardware profile: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a hardware profile must be a JSON object")
    return HardwareProfile.from_dict(data, where=str(path))


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


# ---- probe ------------------------------------------------------------------------------------------------
READ_CHUNK = 4 << 20  # per request, about an expert's size
READ_THREADS = 4  # as the store's reader pool


def measure_direct_read(directory: str | os.PathLike, size: int = 1 << 30) -> tuple[float, float, str]:
    """(GB/s, latency us, method) of O_DIRECT reads of a scratch file written in `directory` (deleted after).
    Falls back to buffered reads after POSIX_FADV_DONTNEED where the filesystem refuses O_DIRECT."""
    path = Path(directory) / f".offload-engine-probe-{os.getpid()}"
    block = os.urandom(1 << 20)
    try:
        with open(path, "wb") as f:
            for _ in range(max(size // len(block), 1)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        size = path.stat().st_size
        method = "O_DIRECT"
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            os.preadv(fd, [mmap.mmap(-1, 4096)], 0)
        except OSError:
            method = "buffered after POSIX_FADV_DONTNEED (O_DIRECT refused)"
            fd = os.open(path, os.O_RDONLY)
        try:
            if method != "O_DIRECT" and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            latency = _read_latency(fd, size)
            if method != "O_DIRECT" and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            offsets = list(range(0, size - READ_CHUNK + 1, READ_CHUNK))
            start = time.perf_counter()
            _parallel_reads(fd, offsets)
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return len(offsets) * READ_CHUNK / seconds / 1e9, latency, method


def _read_latency(fd: int, size: int, n: int = 64) -> float:
    buf = mmap.mmap(-1, 4096)
    step = max((size // n) // 4096 * 4096, 4096)
    start = time.perf_counter()
    for i in range(n):
        os.preadv(fd, [buf], (i * step) % max(size - 4096, 4096))
    return (time.perf_counter() - start) / n * 1e6


def _parallel_reads(fd: int, offsets: list[int]) -> None:
    def worker(mine: list[int]) -> None:
        buf = mmap.mmap(-1, READ_CHUNK)  # page-aligned, as O_DIRECT requires
        for off in mine:
            os.preadv(fd, [buf], off)

    threads = [threading.Thread(target=worker, args=(offsets[i::READ_THREADS],)) for i in range(READ_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _best_seconds(fn, repeats: int, sync=None) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_host(quick: bool = False) -> dict[str, float]:
    """RAM copy GB/s, CPU GEMV GB/s (fp32), CPU GEMM GFLOPS (fp32) and the per-op dispatch latency in us."""
    import torch
    n = 64 << 20 if quick else 256 << 20
    src, dst = torch.ones(n // 4), torch.empty(n // 4)
    copy = n / _best_seconds(lambda: dst.copy_(src), 5) / 1e9
    rows = 4096 if quick else 8192
    w, x = torch.randn(rows, 8192), torch.randn(1, 8192)
    gemv = w.numel() * 4 / _best_seconds(lambda: torch.nn.functional.linear(x, w), 5) / 1e9
    m = 1024 if quick else 2048
    a, b = torch.randn(m, m), torch.randn(m, m)
    gflops = 2 * m ** 3 / _best_seconds(lambda: a @ b, 3) / 1e9
    tiny_w, tiny_x = torch.randn(64, 64), torch.randn(1, 64)
    reps = 2000
    op_us = _best_seconds(lambda: [torch.nn.functional.linear(tiny_x, tiny_w) for _ in range(reps)], 3) / reps * 1e6
    return {"ram_gbps": copy, "cpu_gemv_gbps": gemv, "cpu_gflops": gflops, "cpu_op_us": op_us}


def measure_cuda(quick: bool = False) -> dict[str, float] | None:
    import torch
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    pcie = n / _best_seconds(lambda: dst.copy_(host, non_blocking=True), 5, sync) / 1e9
    w = torch.randn(16384, 16384, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 16384, device=dev, dtype=torch.bfloat16)
    gemv = w.numel() * 2 / _best_seconds(lambda: torch.nn.functional.linear(x, w), 10, sync) / 1e9
    m = 4096 if quick else 8192
    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    tflops = 2 * m ** 3 / _best_seconds(lambda: a @ a, 5, sync) / 1e12
    tiny = torch.randn(1, 64, device=dev)
    tw = torch.randn(64, 64, device=dev)
    reps = 2000
    op_us = _best_seconds(lambda: [torch.nn.functional.linear(tiny, tw) for _ in range(reps)], 3, sync) / reps * 1e6
    free, total = torch.cuda.mem_get_info(dev)
    return {"vram_bytes": int(total), "pcie_gbps": pcie, "gpu_mem_gbps": gemv, "gpu_tflops": tflops,
            "gpu_op_us": op_us, "gpu_name": torch.cuda.get_device_name(dev)}


def ram_total() -> int:
    import psutil
    total = psutil.virtual_memory().total
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text != "max":
            total = min(total, int(text))
    except (OSError, ValueError):
        pass
    return total


def probe(directory: str | os.PathLike = ".", name: str | None = None, read_bytes: int = 1 << 30,
          quick: bool = False) -> HardwareProfile:
    """Measure this machine and return its profile (nothing is written here)."""
    read_gbps, latency, method = measure_direct_read(directory, read_bytes)
    host = measure_host(quick)
    cuda = measure_cuda(quick)
    where = f"probe on {platform.node()} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}"
    sources = {
        "nvme_gbps": f"{method} 4 MiB reads x {READ_THREADS} threads of a {format_bytes(read_bytes)} file in "
                     f"{Path(directory).resolve()}; {where}",
        "ram_gbps": f"torch copy_ of 256 MiB fp32; {where}",
        "cpu_gemv_gbps": f"fp32 [8192 x 8192] @ [1 x 8192], weight bytes / time; {where}",
        "cpu_gflops": f"fp32 2048^3 matmul; {where}",
        "cpu_op_us": f"F.linear [1x64]x[64x64] dispatch; {where}",
    }
    values: dict[str, Any] = {"vram_bytes": 0, "gpu_mem_gbps": 0.0, "gpu_tflops": 0.0, "pcie_gbps": 0.0}
    description = f"probed: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    if cuda:
        gpu_name = cuda.pop("gpu_name")
        values.update(cuda)
        description += f", {gpu_name}"
        sources.update({"pcie_gbps": f"pinned 256 MiB host->device copy; {where}",
                        "gpu_mem_gbps": f"bf16 [16384 x 16384] GEMV; {where}",
                        "gpu_tflops": f"bf16 matmul; {where}", "gpu_op_us": f"tiny F.linear on CUDA; {where}",
                        "vram_bytes": "torch.cuda.mem_get_info total"})
    return HardwareProfile(name=name or platform.node() or "this-machine", description=description,
                           ram_bytes=ram_total(), nvme_gbps=round(read_gbps, 3), nvme_latency_us=round(latency, 1),
                           **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in {**values, **host}.items()},
                           sources=sources)
