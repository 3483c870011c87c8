"""The process group and the ring links between pipeline ranks, with a timeout on every transfer.

Ranks form a ring: each receives only from rank - 1 and sends only to rank + 1 (mod world size), so messages
keep their order and no two ranks ever wait on each other. A message is a fixed header (int64 x HEADER) and
the tensors its op implies. Every send and receive waits at most `timeout` seconds; a peer that died (its
connection closed) or sent nothing in time ends the wait with a RankFailedError naming that rank. A rank
waiting for the next command between requests (a worker's idle wait) uses the group's own, longer timeout.

gloo carries CPU tensors (CPU ranks, or nodes without NCCL); NCCL carries CUDA tensors between GPUs.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError, OffloadEngineError
from ..constants import seconds_from_env

HEADER = 8  # int64 slots of every message's header: op, then the op's numbers
RANK_TIMEOUT_S = 60.0  # default: a transfer within a request waits this long (OFFLOAD_ENGINE_RANK_TIMEOUT)
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # a worker waits this long for the next command (the group's timeout)


class RankFailedError(OffloadEngineError):
    """A pipeline rank died or stalled: the request fails on every rank, naming it."""

    exit_code = 3

    def __init__(self, rank: int, reason: str):
        self.rank = rank
        super().__init__(f"pipeline rank {rank} failed: {reason}")


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    device: torch.device
    backend: str  # "gloo" | "nccl"

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def previous(self) -> int:
        return (self.rank - 1) % self.world_size


def rank_timeout_from_env() -> float:
    """OFFLOAD_ENGINE_RANK_TIMEOUT: seconds a transfer between ranks may wait (default RANK_TIMEOUT_S)."""
    return seconds_from_env("OFFLOAD_ENGINE_RANK_TIMEOUT", RANK_TIMEOUT_S)


def env_topology(device: str | None = None) -> Topology | None:
    """The rank of this process from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) or the launcher's
    (and OFFLOAD_ENGINE_DEVICES, one device per rank); None when not started as a rank."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    devices = os.environ.get("OFFLOAD_ENGINE_DEVICES")
    if devices:
        names = devices.split(",")
        if len(names) != world:
            raise ConfigError(f"--devices names {len(names)} devices for {world} ranks")
        device = names[rank]
    elif device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # --device cuda under torchrun: this rank's local GPU
        dev = torch.device("cuda", local)
    return Topology(rank, world, dev, "nccl" if dev.type == "cuda" else "gloo")


def init_group(topology: Topology, idle_timeout: float = IDLE_TIMEOUT_S) -> None:
    """Join the process group (env:// rendezvous: MASTER_ADDR, MASTER_PORT, or torchrun's)."""
    if topology.device.type == "cuda":
        torch.cuda.set_device(topology.device)
        # NCCL work completes on its stream; blocking wait makes Work.wait(timeout) hold the CPU and honour the
        # timeout, as gloo's does (written for GPUs, not yet run on two of them)
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    if not dist.is_initialized():
        dist.init_process_group(topology.backend, rank=topology.rank, world_size=topology.world_size,
                                timeout=datetime.timedelta(seconds=idle_timeout))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class Link:
    """This rank's two ends of the ring: send to the next rank, receive from the previous one."""

    def __init__(self, topology: Topology, timeout: float):
        self.topology = topology
        self.timeout = timeout
        # what the backend carries: CUDA tensors for NCCL, CPU tensors for gloo
        self.wire = topology.device if topology.backend == "nccl" else torch.device("cpu")

    def send(self, op: int, *numbers: int, tensors: tuple[torch.Tensor, ...] = ()) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = op
        header[1:1 + len(numbers)] = torch.tensor(numbers, dtype=torch.int64)
        for t in (header, *tensors):
            t = t.to(self.wire).contiguous()
            self._wait(lambda: dist.isend(t, self.topology.next), self.topology.next, "send")

    def recv_header(self, idle: bool = False) -> list[int]:
        """The next message's header. idle: waiting for a command (the group's timeout), not within a request."""
        return self.recv((HEADER,), torch.int64, idle=idle).tolist()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, idle: bool = False) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.wire)
        self._wait(lambda: dist.irecv(out, self.topology.previous), self.topology.previous, "receive", idle)
        return out

    def _wait(self, start, peer: int, what: str, idle: bool = False) -> None:
        """start() posts the transfer (a broken connection may fail it at once); then wait for it."""
        try:
            work = start()
            if idle:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:  # gloo / NCCL: a closed connection, or the timeout
            text = str(e)
            if "Timed out" in text or "timeout" in text.lower():
                why = f"sent nothing within {self.timeout:g} s (stalled, or a rank before it did)"
                if what == "send":
                    why = f"took nothing within {self.timeout:g} s (stalled)"
            else:
                why = "its connection closed (the process died or left the group)"
            raise RankFailedError(peer, f"{why}; rank {self.topology.rank}'s {what} failed: "
                                        f"{text.splitlines()[0][:200] if text else type(e).__name__}") from None


def encode_text(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")) or bytearray(b" "), dtype=torch.uint8)


def decode_text(t: torch.Tensor) -> str:
    return bytes(t.cpu().tolist()).decode("utf-8", errors="replace")
