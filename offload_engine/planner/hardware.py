"""Hardware profiles: the bandwidths and throughputs the cost model needs, loaded by name or file, or probed.

A profile is plain data (configs/hardware/NAME.json). Bandwidths are in GB/s (1e9 bytes/s) as *achieved*
figures (what a copy or a kernel really gets), not datasheet peaks; every field's origin is noted in `sources`.
`probe()` measures this machine: O_DIRECT reads from a scratch file, RAM copies, CPU batch-1 matmul (GEMV)
bandwidth and GEMM FLOPs, the per-op dispatch latency, and with CUDA the host->device copy, device GEMV
bandwidth and bf16 GEMM throughput.
"""
from __future__ import annotations

import json
import os
import platform
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
READ_BLOCK = 4 << 20  # per request: about one expert of a large MoE
READ_THREADS = 4  # as the store's reader pool


def _best_seconds(fn, repeats: int, sync=None) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemv(device: str = "cpu", quick: bool = False) -> tuple[float, float]:
    """(weight GB/s of a batch-1 matmul, us per small op): what decode at batch 1 gets from memory, and the
    fixed dispatch cost of one eager op. fp32 on the CPU (the engine's CPU dtype), bf16 on CUDA."""
    import torch
    import torch.nn.functional as F

    cuda = device != "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else None
    if cuda:
        rows = 4096 if quick else 16384
        w = torch.randn(rows, 8192, dtype=dtype, device=device)
        x = torch.randn(1, 8192, dtype=dtype, device=device)
        F.linear(x, w)
        gbps = w.numel() * w.element_size() / _best_seconds(lambda: F.linear(x, w), 5, sync) / 1e9
    else:
        # decode-sized matrices (4 MiB, as experts' are: 1-56 MiB in fp32), cycled through a pool larger than the
        # caches: one large matrix streams faster per byte than the many small ones a decode step multiplies
        ws = [torch.randn(1024, 1024, dtype=dtype) for _ in range(16 if quick else 64)]
        x = torch.randn(1, 1024, dtype=dtype)
        F.linear(x, ws[0])
        gbps = sum(w.numel() * w.element_size() for w in ws) / _best_seconds(
            lambda: [F.linear(x, w) for w in ws], 5, sync) / 1e9
    tw, tx, reps = torch.randn(64, 64, device=device), torch.randn(1, 64, device=device), 2000
    op_us = _best_seconds(lambda: [F.linear(tx, tw) for _ in range(reps)], 3, sync) / reps * 1e6
    return gbps, op_us


def measure_read(directory: str | os.PathLike, nbytes: int) -> tuple[Any, float]:
    """O_DIRECT reads (offload_engine.probe) of a scratch file written in `directory`, 4 MiB x 4 threads,
    and the latency of one 4 KiB read; the file is deleted afterwards."""
    from .. import probe as measure

    path = Path(directory) / f".offload-engine-probe-{os.getpid()}"
    block = os.urandom(1 << 20)
    try:
        with open(path, "wb") as f:
            for _ in range(max(nbytes >> 20, 8)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        bw = measure.measure_direct_read_bandwidth(path, nbytes, READ_BLOCK, READ_THREADS, repeats=3)
        small = measure.measure_direct_read_bandwidth(path, 64 * 4096, 4096, 1)
    finally:
        path.unlink(missing_ok=True)
    return bw, small.seconds / 64 * 1e6


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


def ram_available() -> int:
    """Bytes the OS can give a process now without swapping (MemAvailable)."""
    import psutil

    return int(psutil.virtual_memory().available)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share), else the count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


THIS_MACHINE = "this machine"
# per-core rates for a machine planned without measuring it (`plan` without --hardware): anchored on this project's
# probe of a 2-vCPU EPYC VM (GEMV 16 GB/s, copy 7 GB/s, fp32 GEMM 67-93 GFLOPS) and capped at a desktop's
# dual-channel DDR5 (the rtx4090-24gb profile); the disk is assumed a modest SSD. `plan --probe` measures them all.
_PER_CORE = {"cpu_gemv_gbps": (8.0, 65.0), "ram_gbps": (3.5, 32.0), "cpu_gflops": (40.0, 1000.0)}
_UNMEASURED_GPU = {"gpu_mem_gbps": 300.0, "gpu_tflops": 30.0, "pcie_gbps": 12.0, "gpu_op_us": 8.0}


def this_machine() -> HardwareProfile:
    """The machine `plan` runs on, from what it can see without measuring (instant, deterministic): its CPU
    cores, RAM (total, cgroup-limited) and GPU (CUDA: its memory); the rates are per-core estimates, or for a GPU
    the figures of the shipped profile its name matches (else conservative ones). `probe()` measures instead."""
    import torch

    cores, total, available = cpu_cores(), ram_total(), ram_available()
    rates = {k: round(min(per * cores, cap), 1) for k, (per, cap) in _PER_CORE.items()}
    values: dict[str, Any] = {"vram_bytes": 0, "gpu_mem_gbps": 0.0, "gpu_tflops": 0.0, "pcie_gbps": 0.0}
    gpu = "no GPU"
    estimate = f"estimate: {cores} cores x per-core rate (planner/hardware.py _PER_CORE); `plan --probe` measures it"
    sources = {k: estimate for k in rates}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        match = next((n for n in list_profiles() if n.split("-")[0].removeprefix("rtx") in props.name.lower()), None)
        known = load_profile(match) if match else None
        values = {"vram_bytes": int(props.total_memory),
                  **{k: getattr(known, k) if known else v for k, v in _UNMEASURED_GPU.items()}}
        gpu = f"GPU {props.name} {format_bytes(props.total_memory)}"
        sources.update({k: f"the {match} profile's figure (the GPU's name matches)" if known else
                        "estimate for an unknown GPU; `plan --probe` measures it" for k in _UNMEASURED_GPU})
    sources.update(vram_bytes="torch.cuda device properties" if values["vram_bytes"] else "no CUDA device",
                   ram_bytes="psutil total, limited by the cgroup's memory.max",
                   nvme_gbps="assumed 1 GB/s (a modest SSD); `plan --probe` measures it")
    description = (f"{THIS_MACHINE} ({platform.node() or 'unnamed'}): {_cpu_model() or platform.machine()}, "
                   f"{cores} CPU cores, RAM {format_bytes(total)} ({format_bytes(available)} available now), {gpu}; "
                   f"rates estimated, not measured (--probe measures them)")
    return HardwareProfile(name=THIS_MACHINE, description=description, ram_bytes=total, nvme_gbps=1.0,
                           cpu_op_us=2.0, sources=sources, **rates, **values)


def probe(directory: str | os.PathLike = ".", name: str | None = None, read_bytes: int = 1 << 30,
          quick: bool = False) -> HardwareProfile:
    """Measure this machine and return its profile (nothing is written here)."""
    import torch

    from .. import probe as measure

    where = f"probe on {platform.node()} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}"
    disk, latency = measure_read(directory, read_bytes)
    memcpy = measure.measure_memcpy_bandwidth(64 << 20 if quick else 256 << 20)
    gemm = measure.measure_cpu_matmul_flops(1024 if quick else 2048)
    cpu_gemv, cpu_op = measure_gemv("cpu", quick)
    values: dict[str, Any] = {"vram_bytes": 0, "gpu_mem_gbps": 0.0, "gpu_tflops": 0.0, "pcie_gbps": 0.0}
    sources = {"nvme_gbps": f"{disk.method}, {READ_BLOCK >> 20} MiB x {READ_THREADS} threads, median of 3, scratch "
                            f"file in {Path(directory).resolve()}; {where}",
               "nvme_latency_us": f"one 4 KiB read, {disk.method}; {where}",
               "ram_gbps": f"{memcpy.method}; {where}", "cpu_gflops": f"fp32 {gemm.n}^3 matmul; {where}",
               "cpu_gemv_gbps": f"fp32 [1 x 1024] @ 64 x [1024 x 1024] (4 MiB each), weight bytes / time; {where}",
               "cpu_op_us": f"F.linear [1x64]x[64x64], per call; {where}"}
    description = f"probed: {platform.machine()}, {os.cpu_count()} CPUs"
    if torch.cuda.is_available():
        h2d, mm = measure.measure_h2d_bandwidth(), measure.measure_gpu_matmul_flops(4096 if quick else 8192)
        gpu_gemv, gpu_op = measure_gemv("cuda", quick)
        values = {"vram_bytes": torch.cuda.mem_get_info()[1], "gpu_mem_gbps": round(gpu_gemv, 1),
                  "gpu_tflops": round(mm.flops_per_s / 1e12, 1), "pcie_gbps": round(h2d.bytes_per_s / 1e9, 2),
                  "gpu_op_us": round(gpu_op, 2)}
        description += f", {torch.cuda.get_device_name()}"
        sources.update({"pcie_gbps": f"{h2d.method}; {where}", "gpu_mem_gbps": f"bf16 GEMV; {where}",
                        "gpu_tflops": f"bf16 {mm.n}^3 matmul; {where}", "gpu_op_us": f"tiny F.linear; {where}",
                        "vram_bytes": "torch.cuda.mem_get_info total"})
    return HardwareProfile(
        name=name or platform.node() or "this-machine", description=description, ram_bytes=ram_total(),
        ram_gbps=round(memcpy.bytes_per_s / 1e9, 2), cpu_gemv_gbps=round(cpu_gemv, 2),
        cpu_gflops=round(gemm.flops_per_s / 1e9, 1), nvme_gbps=round(disk.bytes_per_s / 1e9, 3),
        nvme_latency_us=round(latency, 1), cpu_op_us=round(cpu_op, 2), sources=sources, **values)
