"""From a checkpoint and a budget to a planned, allocated TieredStore (the one place that decides tiers)."""
from __future__ import annotations

import os

import psutil
import torch

from ..checkpoint.model import ModelCheckpoint
from ..config import ResolvedBudget
from ..errors import ConfigError
from ..planner.placement import KindSize, Placement, plan_placement
from ..planner.placement import kind_sizes as placement_kind_sizes
from .disk import ALIGN, BOUNCE_BYTES, DIRECT_SLACK
from .ledger import Ledger
from .store import PREFETCH_SLOTS, CopyFn, ReadFn, TieredStore

READER_THREADS = 4
STALL_TIMEOUT_S = 60.0


def kind_sizes(checkpoint: ModelCheckpoint, slack: int = 0) -> dict[str, KindSize]:
    return placement_kind_sizes({key: layout.nbytes for key, layout in checkpoint.layouts.items()}, slack)


MIN_BOUNCE = 64 * 1024
STAGING_SHARE = 8  # the O_DIRECT bounce buffers take at most 1/8 of the budget of the tier that holds them


def bounce_bytes(sizes: dict[str, KindSize], budget: int | None = None) -> int:
    """O_DIRECT bounce buffer per reader thread: the largest unit plus alignment slack, at most BOUNCE_BYTES, and
    with a `budget`, at most its 1/STAGING_SHARE over the readers (never under MIN_BOUNCE): a small budget reads
    in smaller aligned pieces rather than spending most of itself on staging."""
    largest = max(s.slot_bytes for s in sizes.values())
    size = min(BOUNCE_BYTES, -(-largest // ALIGN) * ALIGN + ALIGN)
    if budget is not None:
        size = min(size, max(MIN_BOUNCE, budget // (STAGING_SHARE * READER_THREADS) // ALIGN * ALIGN))
    return size


def host_memory_limit() -> int:
    """min(cgroup memory.max, MemAvailable): what this process can really use (RELIABILITY M5)."""
    limit = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text != "max":
            limit = min(limit, int(text))
    except (OSError, ValueError):
        pass
    return limit


def plan_for(checkpoint: ModelCheckpoint, budget: ResolvedBudget, device: torch.device, kv_bytes: int,
             direct_io: str) -> tuple[Placement, bool]:
    sizes = kind_sizes(checkpoint)
    separate_host = device.type == "cuda" or budget.device is not None
    use_direct = direct_io == "on"
    if direct_io == "auto":
        ram = budget.host if separate_host else (budget.host if budget.host is not None else None)
        use_direct = ram is not None and ram < checkpoint.total_bytes
    elif direct_io not in ("on", "off"):
        raise ConfigError(f"--direct-io must be auto, on or off, got {direct_io!r}")
    if use_direct:  # every slot can take an O_DIRECT read straight, with its page slack (disk.read_unit_direct)
        sizes = kind_sizes(checkpoint, DIRECT_SLACK)
    staging = READER_THREADS * bounce_bytes(sizes, budget.host) if use_direct else 0
    if separate_host:
        compute_budget = budget.device
        if compute_budget is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            compute_budget = int(free * 0.9)
        # CUDA reads pass through host slots (TieredStore._read_via_host): one per reader thread and kind, so a
        # read never finds every host slot of its kind taken
        placement = plan_placement(sizes, compute_budget, budget.host, kv_bytes, staging, separate_host=True,
                                   host_staging=READER_THREADS if device.type == "cuda" else 0)
    else:
        placement = plan_placement(sizes, budget.host, None, kv_bytes, staging, separate_host=False)
    return placement, use_direct


def stall_timeout_from_env() -> float:
    """OFFLOAD_ENGINE_STALL_TIMEOUT: seconds without any read progress before a request fails with an
    IOStallError (default STALL_TIMEOUT_S; the watchdog measures progress, so slow disks that keep delivering
    never trip it)."""
    text = os.environ.get("OFFLOAD_ENGINE_STALL_TIMEOUT")
    if text is None:
        return STALL_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also rejects nan
        raise ConfigError(f"OFFLOAD_ENGINE_STALL_TIMEOUT must be a positive number of seconds, got {text!r}")
    return value


def gds_from_env() -> bool:
    """OFFLOAD_ENGINE_GDS: 'auto' (default: GPUDirect reads when kvikio and CUDA are present) or 'off'."""
    text = os.environ.get("OFFLOAD_ENGINE_GDS", "auto")
    if text not in ("auto", "off"):
        raise ConfigError(f"OFFLOAD_ENGINE_GDS must be 'auto' or 'off', got {text!r}")
    return text == "auto"


def build_store(checkpoint: ModelCheckpoint, placement: Placement, device: torch.device, dtype: torch.dtype,
                direct_io: bool, policy: str, progress: bool, read_fn: ReadFn | None = None,
                stall_timeout: float | None = None, copy_fn: CopyFn | None = None,
                prefetch_slots: int = PREFETCH_SLOTS) -> TieredStore:
    ledger = Ledger({t.name: t.budget for t in placement.tiers})
    timeout = stall_timeout or stall_timeout_from_env()
    staged = max(t.staging_bytes for t in placement.tiers)  # what plan_for charged for the bounce buffers
    bounce = staged // READER_THREADS or bounce_bytes(placement.sizes)
    return TieredStore(checkpoint, placement, ledger, device, dtype, policy=policy, direct_io=direct_io,
                       threads=READER_THREADS, bounce_bytes=bounce, gds=gds_from_env(), stall_timeout=timeout,
                       read_fn=read_fn, copy_fn=copy_fn, prefetch_slots=prefetch_slots, progress=progress)
