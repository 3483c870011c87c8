"""The physical bound per decode token, for tools/bench.py: what the machine's memory and disk allow, whatever the
engine's own resident speed is.

- **resident**: the weight bytes one decode token touches (every non-expert weight, `top_k` of each MoE layer's
  experts, one embedding row) over the measured memory read bandwidth (one large float32 tensor summed by
  torch's threads, best of a few: a pure streaming read, the access pattern of decode's GEMVs);
- **disk**: the bytes a budgeted run read and used per token (missed experts) over the O_DIRECT bandwidth the
  bench measures around each budget's runs.

The bound is max(resident, disk): reads overlap compute, so neither can be hidden below the other. The KV cache
read per token is left out (under 0.5 MB at the bench's context: ~0.1% of the weights).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20


@dataclass(frozen=True)
class MemoryBandwidth:
    bytes_per_s: float  # the best sample: the bound must not be slower than what the machine did once
    samples: list[float]
    nbytes: int
    threads: int
    method: str


def measure_memory_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7,
                                  threads: int | None = None) -> MemoryBandwidth:
    """Bytes per second torch reads from RAM: `tensor.sum()` over `nbytes` of float32 (default 1 GiB, far above
    any last-level cache), first pass untimed (it faults the pages in), the best of `repeats`."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        t.sum()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            t.sum()
            samples.append(nbytes / (time.perf_counter() - start))
        n = torch.get_num_threads()
        del t
    finally:
        torch.set_num_threads(old)
    return MemoryBandwidth(max(samples), samples, nbytes, n, "torch float32 sum (read once)")


@dataclass(frozen=True)
class ActiveBytes:
    """Weight bytes one decode token reads, from the checkpoint's own tensor sizes."""

    per_token: int
    experts: int  # top_k / num_experts of every routed expert tensor
    dense: int  # everything else (attention, norms, routers, lm_head) but the embedding
    embedding_row: int
    total: int  # every tensor's bytes (for reference)
    source: str


def _safetensors_sizes(folder: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        sizes.update({n: i["data_offsets"][1] - i["data_offsets"][0] for n, i in header.items() if n != "__metadata__"})
    return sizes


def active_bytes_hf(folder: str | Path) -> ActiveBytes:
    """A Hugging Face MoE (or dense) folder: expert tensors are those named `.experts.`; `embed_tokens` counts
    one row (a lookup); a tied lm_head reads the whole matrix once."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    config = {**config, **config.get("text_config", {})}
    sizes = _safetensors_sizes(folder)
    if not sizes:
        raise FileNotFoundError(f"{folder}: no safetensors shards")
    vocab, tied = int(config["vocab_size"]), bool(config.get("tie_word_embeddings"))
    share = int(config.get("num_experts_per_tok") or 0) / max(1, int(config.get("num_experts") or
                                                                    config.get("num_local_experts") or 1))
    experts = sum(b for n, b in sizes.items() if ".experts." in n)
    embed = sum(b for n, b in sizes.items() if "embed_tokens" in n)
    dense = sum(b for n, b in sizes.items() if ".experts." not in n and "embed_tokens" not in n)
    row = embed // vocab if embed else 0
    dense += embed if tied else 0  # the tied head reads the whole matrix
    expert_bytes = int(experts * share)
    return ActiveBytes(expert_bytes + dense + row, expert_bytes, dense, row, sum(sizes.values()), str(folder))


def active_bytes_gguf(path: str | Path, top_k: int, num_experts: int) -> ActiveBytes:
    """A GGUF: `*_exps` tensors hold every expert of a layer (top_k / num_experts of them are read); token_embd
    one row; an absent output.weight means the head is tied to token_embd (read whole)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    experts = sum(b for n, b in sizes.items() if "_exps" in n)
    embed = sizes.get("token_embd.weight", 0)
    vocab = next((int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight"), 1)
    dense = sum(b for n, b in sizes.items() if "_exps" not in n and n != "token_embd.weight")
    dense += embed if "output.weight" not in sizes else 0
    row = embed // max(1, vocab)
    expert_bytes = int(experts * top_k / max(1, num_experts))
    return ActiveBytes(expert_bytes + dense + row, expert_bytes, dense, row, sum(sizes.values()), str(path))


@dataclass(frozen=True)
class PhysicalBound:
    resident_s: float  # active bytes / memory read bandwidth
    disk_s: float  # bytes read and used per token / O_DIRECT bandwidth (0 when nothing was read)
    s_per_token: float  # max of the two
    measured_s: float
    measured_vs_bound: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def physical_bound(active: ActiveBytes, mem_bw: float, measured_s: float, missed_bytes: float = 0.0,
                   disk_bw: float | None = None) -> PhysicalBound:
    resident = active.per_token / mem_bw
    disk = missed_bytes / disk_bw if missed_bytes and disk_bw else 0.0
    bound = max(resident, disk)
    return PhysicalBound(resident, disk, bound, measured_s, measured_s / bound)


def summary(active: ActiveBytes, mem: MemoryBandwidth) -> dict[str, Any]:
    """The JSON's `physical` section."""
    return {"active_bytes": asdict(active), "memory_read": asdict(mem),
            "resident_bound_s_per_token": active.per_token / mem.bytes_per_s,
            "memory_read_median": statistics.median(mem.samples)}
