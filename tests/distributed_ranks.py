"""Run pipeline ranks as processes on this box (gloo) for the distributed tests: each job opens one pipeline
with its options on every rank, rank 0 runs its requests, and their results come back to the test."""
from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, jobs: list[dict[str, Any]], out: str) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OFFLOAD_ENGINE_DEVICE="cpu")
    torch.set_num_threads(1)
    from offload_engine.config import EngineConfig
    from offload_engine.distributed.engine import open_rank, serve_rank
    from offload_engine.distributed.group import leave_group

    results = []
    for job in jobs:
        handle = open_rank(job["path"], EngineConfig.from_keywords(device="cpu", **job.get("options", {})))
        if rank != 0:
            serve_rank(handle)
            continue
        try:
            done = {}
            for name, (prompt, sampling) in job.get("generate", {}).items():
                c = handle.generate(prompt, **sampling)
                done[name] = {"tokens": c.token_ids, "stats": c.stats}
            if "logits" in job:
                done["logits"] = handle.logits(job["logits"])
            results.append(done)
        finally:
            handle.close()
    leave_group()
    if rank == 0:
        torch.save(results, out)


def run_ranks(world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every job on `world` rank processes; rank 0's results, one dict per job."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.start_processes(_rank, args=(world, free_port(), jobs, out), nprocs=world, start_method="spawn")
        return torch.load(out)
