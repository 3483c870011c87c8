"""`--devices cpu,cpu` (or cuda:0,cuda:1): start one process per device on this box, as torchrun would.

Each child runs the same command line without --devices, with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and OFFLOAD_ENGINE_DEVICES naming every rank's device. Rank 0's output is
this command's; the others' stdout is dropped (their errors still reach stderr). When a rank exits with an
error, the others fail on their own within the rank timeout (they find it dead or silent); any still running
after that and a grace period are killed, so the command never hangs.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

import torch

from ..errors import ConfigError

GRACE_S = 10.0  # beyond the rank timeout, before the ranks still running after a failure are killed


def parse_devices(text: str) -> list[str]:
    """'cpu,cpu' / 'cuda:0,cuda:1' -> one device per rank; ConfigError naming --devices otherwise."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError("--devices: give one device per rank, e.g. cpu,cpu or cuda:0,cuda:1")
    kinds = set()
    for n in names:
        try:
            kinds.add(torch.device(n).type)
        except (RuntimeError, TypeError):
            raise ConfigError(f"--devices: {n!r} is not a device (expected cpu or cuda:N)") from None
    if not kinds <= {"cpu", "cuda"}:
        raise ConfigError(f"--devices: only cpu and cuda devices are supported, got {text!r}")
    if len(kinds) > 1:
        raise ConfigError(f"--devices {text!r}: all ranks on CPUs (gloo) or all on GPUs (NCCL), not a mix")
    if "cuda" in kinds and not torch.cuda.is_available():
        raise ConfigError(f"--devices {text!r}: CUDA is not available on this machine")
    return names


def without_devices(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--devices":
            skip = True
        elif not a.startswith("--devices="):
            out.append(a)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(devices: list[str], argv: Sequence[str], rank_timeout: float) -> int:
    """Run the command once per device; the exit status of rank 0 (or of the first rank that failed)."""
    port, world = free_port(), len(devices)
    command = [sys.executable, "-m", "offload_engine.cli", *without_devices(argv)]
    procs = []
    try:
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OFFLOAD_ENGINE_DEVICES": ",".join(devices)}
            procs.append(subprocess.Popen(command, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
        return _wait(procs, rank_timeout + GRACE_S)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        _wait(procs, GRACE_S)
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _wait(procs: list[subprocess.Popen], grace: float) -> int:
    """Until every rank exits; after the first failure the others get `grace` seconds, then are killed."""
    failed_at, status = None, 0
    while any(p.poll() is None for p in procs):
        codes = [p.poll() for p in procs]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    codes = [p.wait() for p in procs]
    if codes[0] != 0:
        return codes[0] if codes[0] > 0 else 1
    status = next((c for c in codes if c != 0), 0)
    return status if status > 0 else (1 if status else 0)
