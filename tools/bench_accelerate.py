"""tools/bench.py's peer: transformers + accelerate disk offload at the same RAM budget (device_map="auto" with a
CPU budget; without a GPU what does not fit goes to an offload folder on disk), decoding the same greedy tokens
with the page cache bypassed (its files evicted before each step) or allowed."""
from __future__ import annotations

import gc
import logging as std_logging
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import torch
from tqdm.auto import tqdm

from offload_engine.probe import Meter
from tools.bench_common import PeerRun, evict, settle_freed_memory, wait_for_quiet

def load_peer(model: Path, budget_bytes: int, offload: Path):
    """accelerate's own path for "what does not fit in RAM goes to disk": device_map="auto" with a CPU budget
    (on a machine without GPU the remaining modules are placed on "disk" and loaded by hooks at each forward)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    std_logging.getLogger("accelerate.big_modeling").setLevel(std_logging.ERROR)  # "offloaded": expected here
    return AutoModelForCausalLM.from_pretrained(model, device_map="auto", max_memory={"cpu": budget_bytes},
                                                offload_folder=str(offload), dtype=torch.float32).eval()


def placed_bytes(peer) -> dict[str, int]:
    """Parameter bytes per device of accelerate's device map (offloaded parameters are meta: shapes suffice)."""
    dmap = getattr(peer, "hf_device_map", {"": "cpu"})
    out: dict[str, int] = {}
    for name, p in peer.named_parameters():
        prefix = max((k for k in dmap if k == "" or name == k or name.startswith(k + ".")), key=len, default="")
        dev = str(dmap.get(prefix, "cpu"))
        out[dev] = out.get(dev, 0) + p.numel() * p.element_size()
    return out


@torch.inference_mode()
def decode_peer(peer, prompt: list[int], steps: int, evict_files: list[Path] | None, progress: bool,
                desc: str, quiet: float = 0.0) -> tuple[list[int], Meter]:
    """Greedy decode with the KV cache, one forward per token (the engine's work); only the steps are timed.
    evict_files: evicted from the page cache before every step (outside the timed interval)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=peer.config)
    kw = "cache" if "cache" in _forward_params(peer) else "past_key_values"
    logits = peer(torch.tensor([prompt]), use_cache=True, **{kw: cache}).logits
    tokens, meter = [int(logits[0, -1].argmax())], Meter()
    wait_for_quiet(quiet)
    for _ in tqdm(range(steps), desc=desc, unit="tok", leave=False, disable=not progress):
        if evict_files:
            evict(evict_files)
        meter.start()
        logits = peer(torch.tensor([[tokens[-1]]]), use_cache=True, **{kw: cache}).logits
        tokens.append(int(logits[0, -1].argmax()))
        meter.stop()
    return tokens, meter


def _forward_params(peer) -> set[str]:
    import inspect

    return set(inspect.signature(peer.forward).parameters)


def run_peer(model: Path, pct: float, budget_bytes: int, modes: list[str], prompt: list[int], steps: int,
             work: Path, progress: bool, quiet: float = 0.0) -> dict[str, PeerRun]:
    offload = Path(tempfile.mkdtemp(prefix="peer-offload-", dir=work))
    peer = None
    try:
        start = time.perf_counter()
        peer = load_peer(model, budget_bytes, offload)
        load_s = time.perf_counter() - start
        placed = placed_bytes(peer)
        files = sorted(offload.rglob("*.safetensors")) + sorted(model.glob("*.safetensors"))
        evict(files, sync=True)  # written during the load: flush them so that eviction really evicts
        runs = {}
        for mode in modes:
            tokens, m = decode_peer(peer, prompt, steps, files if mode == "bypass" else None, progress,
                                    f"peer {pct:g}% {mode}", quiet)
            runs[mode] = PeerRun(pct, mode, tokens, steps, m.wall, m.wall / steps, steps / m.wall, m.per(steps),
                                 m.cpu_util, m.others_cpu, placed.get("disk", 0), placed.get("cpu", 0), load_s)
        return runs
    finally:
        rss = psutil.Process().memory_info().rss
        del peer
        gc.collect()
        settle_freed_memory(rss)
        shutil.rmtree(offload, ignore_errors=True)
