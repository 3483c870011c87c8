"""`run` across ranks: under torchrun (or the --devices launcher) this process is one rank; rank 0 generates and
prints, the others serve it. `run --devices A,B` outside torchrun starts the ranks itself (launch.py)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from ..config import EngineConfig
from ..errors import ConfigError
from .engine import open_rank, serve_rank
from .group import env_topology, leave_group, rank_timeout_from_env
from .launch import launch, parse_devices


def started_as_rank() -> bool:
    """torchrun's (or the launcher's) environment is set: this process is one rank of a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def this_ranks_share(values: str | None, flag: str) -> str | None:
    """--ram / --vram given per rank ("64GiB,32GiB"): this rank's value (the launcher, not yet a rank, keeps the
    list for its ranks); one value applies to every rank."""
    if values is None or "," not in values or not started_as_rank():
        return values
    parts = values.split(",")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if len(parts) != world:
        raise ConfigError(f"{flag} {values!r}: {len(parts)} values for {world} ranks (give one, or one per rank)")
    return parts[rank].strip()


def run_ranked(model: str, config: EngineConfig, devices: str | None, argv: list[str],
               generate: Callable[[Any], int], split: str | None = None) -> int:
    """Launch the ranks (--devices, not yet a rank) or be one: rank 0 calls generate(engine) and returns its
    status; the other ranks serve until rank 0 closes and return 0. split: --split, the stages' layer ranges
    (OFFLOAD_ENGINE_SPLIT, which the launched ranks inherit)."""
    if split:
        os.environ["OFFLOAD_ENGINE_SPLIT"] = split
    if not started_as_rank():
        return launch(parse_devices(devices or ""), argv, rank_timeout_from_env())
    if devices and "OFFLOAD_ENGINE_DEVICES" not in os.environ:  # torchrun with --devices: one device per rank
        os.environ["OFFLOAD_ENGINE_DEVICES"] = ",".join(parse_devices(devices))
    topology = env_topology(None if config.device is None else str(config.device))
    if topology.rank != 0:
        config = dataclasses.replace(config, progress=False)
    try:
        handle = open_rank(model, config, topology)
        if topology.rank != 0:
            serve_rank(handle)
            return 0
        try:
            return generate(handle)
        finally:
            handle.close()
    finally:
        leave_group()
