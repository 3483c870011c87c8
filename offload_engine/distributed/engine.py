"""Opening one rank of a pipeline: rank 0 gets an Engine (the ordinary facade, over a PipelineLM), every other
rank a StageWorker that serves it. All ranks call `open_rank` with the same checkpoint and options."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..api import Engine
from ..assemble import EngineParts, assemble
from ..checkpoint.gguf.reader import is_gguf
from ..checkpoint.hf_config import parse_config
from ..checkpoint.index import CheckpointIndex, load_json
from ..checkpoint.model import open_model
from ..checkpoint.stage import Stage
from ..config import EngineConfig
from ..errors import ConfigError
from ..generate.decoder import FinishEvent
from ..planner.kv import layer_types
from ..planner.split import RankSpec, Tier, layer_costs, split_layers
from ..runtime.mtp import attach_mtp_units
from .group import Link, RankFailedError, Topology, env_topology, init_group, rank_timeout_from_env
from .pipeline import PipelineLM, Ring
from .worker import StageWorker, rank_figures


class PipelineEngine(Engine):
    """Rank 0's engine: an Engine whose model runs the earlier layers on the other ranks; its stats carry
    world_size and each rank's layers and memory. close() also ends the other ranks' serving."""

    def __init__(self, parts: EngineParts, ring: Ring | None, topology: Topology, stage: Stage | None):
        super().__init__(parts)
        self.ring, self.topology, self.stage, self.parts = ring, topology, stage, parts

    def stats(self, finish: FinishEvent, before: dict | None = None, decoding: dict | None = None
              ) -> dict[str, Any]:
        out = super().stats(finish, before, decoding)
        others = self.ring.stats() if self.ring is not None else []
        ranks = sorted([rank_figures(0, self.stage, self.parts)] + others, key=lambda r: r["rank"])
        return {**out, "world_size": self.topology.world_size, "ranks": ranks}

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.ring is not None:
                self.ring.close()


def stage_of(rank: int, world_size: int) -> int:
    """Pipeline stage of a rank: rank 1 runs stage 0 (the embedding), rank 0 the last stage (head, sampling)."""
    return (rank - 1) % world_size


def engine_split(path: str | os.PathLike, config: EngineConfig, world_size: int) -> list[tuple[int, int]]:
    """Layer ranges per stage for ranks alike (the same budgets and hardware): balanced bytes read per token.
    OFFLOAD_ENGINE_SPLIT ("0:2,2:4": stage by stage) sets them instead."""
    n = layer_count(path, config.allow_cast)
    text = os.environ.get("OFFLOAD_ENGINE_SPLIT")
    if text:
        try:
            ranges = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
            stages = [Stage(*r, n) for r in ranges]
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--split / OFFLOAD_ENGINE_SPLIT {text!r}: expected start:stop per stage, e.g. "
                              f"0:2,2:4 ({e})") from None
        if len(stages) != world_size or [s.start for s in stages] != [0] + [s.stop for s in stages[:-1]] \
                or stages[-1].stop != n:
            raise ConfigError(f"--split / OFFLOAD_ENGINE_SPLIT {text!r}: {world_size} contiguous ranges covering "
                              f"layers 0-{n - 1} expected")
        return [(s.start, s.stop) for s in stages]
    if not is_gguf(path) and CheckpointIndex.open(path, missing_shards_ok=True).absent:
        raise ConfigError(f"{path} holds only some of the checkpoint's shards (a rank's local copy): pass --split "
                          f"(e.g. from `plan --ranks`) so that each rank knows its layers without the others' files")
    checkpoint = open_model(path, allow_cast=config.allow_cast)
    if config.speculative.mode in ("auto", "mtp"):
        checkpoint = attach_mtp_units(checkpoint)
    units = {key: layout.nbytes for key, layout in checkpoint.layouts.items()}
    layers, extras = layer_costs(units, checkpoint.spec, 1, 4)  # the weights decide: KV is alike per layer
    ranks = [RankSpec(f"stage {s}", (Tier(None, 1.0),), 1.0) for s in range(world_size)]
    return split_layers(layers, ranks, extras).ranges


def layer_count(path: str | os.PathLike, allow_cast: bool) -> int:
    """The model's decoder layers, from config.json alone (a rank's folder may hold only its own shards)."""
    if is_gguf(path):
        return open_model(path, allow_cast=allow_cast).spec.num_layers
    config = Path(path) / "config.json"
    return parse_config(load_json(config, "config.json"), config).num_layers


def open_rank(path: str | os.PathLike, config: EngineConfig, topology: Topology | None = None, *,
              timeout: float | None = None) -> Engine | StageWorker:
    """Join the process group and open this rank's stage. Rank 0: a PipelineEngine (close it when done: that
    also ends the others' serving); other ranks: a StageWorker (serve_rank). A rank that cannot open its stage
    fails every rank's open_rank with an error naming it. The process stays in the group (leave_group()).
    timeout: seconds a transfer within a request may wait (default OFFLOAD_ENGINE_RANK_TIMEOUT, or 60). All ranks
    pass the same checkpoint and options (budgets apply per rank; percentages are of the rank's own units)."""
    topology = topology or env_topology(None if config.device is None else str(config.device))
    if topology is None:
        raise ConfigError("open_rank: not started as a rank (RANK and WORLD_SIZE unset): use torchrun or --devices")
    init_group(topology)
    config = dataclasses.replace(config, device=topology.device)
    world, rank = topology.world_size, topology.rank
    parts, stage, failure = None, None, ""
    try:
        if world > 1:
            start, stop = engine_split(path, config, world)[stage_of(rank, world)]
            stage = Stage(start, stop, layer_count(path, config.allow_cast))
        parts = assemble(path, config, stage=stage)
    except Exception as e:  # every rank learns which one could not open, then each raises
        failure = f"{type(e).__name__}: {e}"
        error = e
    statuses: list[Any] = [None] * world
    dist.all_gather_object(statuses, failure)  # the group's (long) timeout: loading may take a while
    if failure:
        raise error
    failed = [(r, s) for r, s in enumerate(statuses) if s]
    if failed:
        parts.close()
        raise RankFailedError(failed[0][0], f"could not open its stage: {failed[0][1]}")
    link = Link(topology, timeout if timeout is not None else rank_timeout_from_env())
    if rank != 0:
        return StageWorker(parts, link, stage)
    recurrent = "linear_attention" in layer_types(parts.model.spec)
    ring = Ring(link, parts.model.spec.hidden_size, recurrent) if world > 1 else None
    if ring is not None:
        parts = dataclasses.replace(parts, model=PipelineLM(parts.model, ring))
    return PipelineEngine(parts, ring, topology, stage)


def serve_rank(worker: StageWorker) -> None:
    """A worker's whole life: serve until rank 0 closes, then close its stage (the process stays in the group:
    rank 0 may open another pipeline; leave_group() when done)."""
    try:
        worker.serve()
    finally:
        worker.close()


__all__ = ["PipelineEngine", "open_rank", "serve_rank", "engine_split"]
