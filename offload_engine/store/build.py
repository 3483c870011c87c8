"""From a checkpoint and the planner's Placement to an allocated TieredStore (the planner decides the tiers)."""
from __future__ import annotations

import os
from typing import Callable

import torch

from ..checkpoint.layout import UnitLayout
from ..checkpoint.model import ModelCheckpoint
from ..config import PREFETCH_SLOTS
from ..constants import READER_THREADS, STALL_TIMEOUT_S, seconds_from_env
from ..errors import ConfigError
from ..planner.kv import prompt_cache_bytes
from ..planner.placement import Placement, ResolvedBudget, bounce_bytes, place
from .ledger import Ledger
from .store import CopyFn, ReadFn, TieredStore

FIT_RESERVE = 1 << 30  # memory a run without --ram leaves the machine at least (fitted_host_budget)


def plan_for(checkpoint: ModelCheckpoint, budget: ResolvedBudget, device: torch.device, kv_bytes: int,
             direct_io: str, room: Callable[[UnitLayout], int] | None = None, cache_ram: int | str = 0
             ) -> tuple[Placement, bool]:
    """The planner's placement (planner.placement.place) for this checkpoint on `device`: this only gathers its
    inputs, the units' bytes and, on CUDA without a device budget, 90% of the VRAM free now. `room`: what a
    slot needs beyond a unit's bytes (the CPU kernels' forms: planner/kernel_room.py). cache_ram: the prompt
    cache's bytes (--cache-ram, planner.kv.prompt_cache_bytes), charged to the host tier."""
    device_budget = budget.device
    if device_budget is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        device_budget = int(free * 0.9)
    units = {key: layout.nbytes + (room(layout) if room else 0) for key, layout in checkpoint.layouts.items()}
    host_budget = budget.host
    cache = prompt_cache_bytes(cache_ram, host_budget, checkpoint.index.total_bytes)
    if host_budget is None and device_budget is None:  # no --ram on a CPU: what this machine has room for
        host_budget = fitted_host_budget(sum(units.values()) + kv_bytes + cache, available_memory())
        cache = prompt_cache_bytes(cache_ram, host_budget, checkpoint.index.total_bytes)  # auto: of that budget
    return place(units, device_budget=device_budget, host_budget=host_budget, kv_bytes=kv_bytes,
                 direct_io=direct_io, gpu=device.type == "cuda", prompt_cache_bytes=cache)


def available_memory() -> int:
    """Bytes the OS can give this process now without swapping (MemAvailable: free memory plus the page cache
    and other reclaimable memory)."""
    import psutil

    return int(psutil.virtual_memory().available)


def fitted_host_budget(need: int, available: int) -> int | None:
    """The RAM budget of a run given none (llama.cpp's --fit): unbounded (everything pinned, as before) where the
    model, its kernel forms and its KV cache fit what is available less a reserve, else that much, so the model
    streams from disk instead of pushing the machine into swap or the OOM killer (a 32 GB checkpoint on a 23 GiB
    machine). The reserve (1 GiB, or 5% of what is available if more) is left for the interpreter, activations and
    the rest of the machine."""
    room = available - max(FIT_RESERVE, available // 20)
    if need <= room:
        return None
    if room <= 0:
        raise ConfigError(f"only {available / 2**30:.2f} GiB of memory is available: not enough to run this model "
                          f"(give --ram to choose a budget)")
    return room


def stall_timeout_from_env() -> float:
    """OFFLOAD_ENGINE_STALL_TIMEOUT: seconds without any read progress before a request fails with an
    IOStallError (default STALL_TIMEOUT_S; the watchdog measures progress, so slow disks that keep delivering
    never trip it)."""
    return seconds_from_env("OFFLOAD_ENGINE_STALL_TIMEOUT", STALL_TIMEOUT_S)


def gds_from_env() -> bool:
    """OFFLOAD_ENGINE_GDS: 'auto' (default: GPUDirect reads when kvikio and CUDA are present) or 'off'."""
    text = os.environ.get("OFFLOAD_ENGINE_GDS", "auto")
    if text not in ("auto", "off"):
        raise ConfigError(f"OFFLOAD_ENGINE_GDS must be 'auto' or 'off', got {text!r}")
    return text == "auto"


def build_store(checkpoint: ModelCheckpoint, placement: Placement, device: torch.device, dtype: torch.dtype,
                direct_io: bool, policy: str, progress: bool, read_fn: ReadFn | None = None,
                stall_timeout: float | None = None, copy_fn: CopyFn | None = None,
                prefetch_slots: int = PREFETCH_SLOTS, prepare=None, keep_cache: bool = True) -> TieredStore:
    """keep_cache=False: buffered reads leave no pages in the page cache (UnitIO), for --direct-io auto under a
    RAM budget the weights fit: O_DIRECT is off there, and the cached copy would double what the budget holds."""
    ledger = Ledger({t.name: t.budget for t in placement.tiers})
    timeout = stall_timeout or stall_timeout_from_env()
    staged = max(t.staging_bytes for t in placement.tiers)  # what the placement charged for the bounce buffers
    bounce = staged // READER_THREADS or bounce_bytes(placement.sizes)
    return TieredStore(checkpoint, placement, ledger, device, dtype, policy=policy, direct_io=direct_io,
                       threads=READER_THREADS, bounce_bytes=bounce, gds=gds_from_env(), stall_timeout=timeout,
                       read_fn=read_fn, copy_fn=copy_fn, prefetch_slots=prefetch_slots, progress=progress,
                       prepare=prepare, keep_cache=keep_cache)
