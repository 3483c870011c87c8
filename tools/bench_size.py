#!/usr/bin/env python3
"""The real-size bench: a 30B-A3B-shaped MoE, the engine and llama.cpp on the same files, in one run, one table.

Rows (each engine row runs in a fresh process, its checkpoint evicted from the page cache first: a cold start):
  - fits RAM: the engine with no budget flags on the 4-bit GGUF, on its compressed-tensors int4 copy (`--ct`), and
    llama.cpp's llama-bench (tg, default options, same threads) on the 4-bit GGUF;
  - beyond RAM: the engine at `--ram 12GiB` and `--ram 25%` on the 8-bit GGUF, and llama-bench on it (default mmap).
Each row: decode tok/s (all steps, and steady: the median step after the first two), the first decode step,
open time and time to first token from the cold start, bytes read from disk per token (the OS's count: the
engine's /proc/self/io, llama.cpp's getrusage of its children), peak RSS, the checkpoint's pages in the page cache
at the end, the expert-cache hit rate (the locality the routing gave), `offload-engine plan --probe`'s prediction
for the same flags, and the physical bound: active bytes / memory bandwidth, and missed bytes / the disk's rate.

    python tools/synthetic_gguf.py --config configs/models/Qwen3-30B-A3B.json --type Q4_0 --out /work/big/q30b-Q4_0.gguf
    python tools/synthetic_gguf.py --config configs/models/Qwen3-30B-A3B.json --type Q8_0 --out /work/big/q30b-Q8_0.gguf
    python tools/bench_size.py --gguf4 /work/big/q30b-Q4_0.gguf --gguf8 /work/big/q30b-Q8_0.gguf --out bench-size.json

A CI-size run of the same path (the real widths, two layers, a few experts) is tests/test_bench_size.py.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_common import evict  # noqa: E402
from tools.bench_physical import active_bytes_gguf, active_bytes_hf  # noqa: E402
from tools.page_cache import cached_bytes  # noqa: E402

GiB = 1 << 30


@dataclass
class SizeRow:
    name: str
    who: str  # "engine" or "llama.cpp"
    model: str
    ram: str | None  # the engine's --ram (None: no budget flags)
    tok_s: float = 0.0  # all decode steps
    steady_tok_s: float = 0.0  # median step after the first two (llama-bench: its mean)
    first_step_s: float | None = None
    open_s: float | None = None
    ttft_s: float | None = None  # from the cold start: open + the prompt's forward
    disk_bytes_per_token: float | None = None
    peak_rss: int | None = None
    page_cache_bytes: int | None = None  # the checkpoint's pages cached at the end
    hit_rate: float | None = None
    predicted_tok_s: float | None = None
    bound_s: float | None = None  # max(resident, disk) per token
    bound_parts: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


# ---- one engine row, in its own process ------------------------------------------------------------------------
def checkpoint_files(model: Path) -> list[Path]:
    return [model] if model.is_file() else sorted(model.glob("*.safetensors"))


def os_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def engine_vocab(model: Path) -> int:
    if model.is_file():
        from gguf import GGUFReader

        return len(GGUFReader(str(model)).fields["tokenizer.ggml.tokens"].data)
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def engine_row(model: Path, ram: str | None, prompt_len: int, tokens: int, threads: int,
               engine_threads: str = "auto") -> dict[str, Any]:
    import torch

    from offload_engine import Budget, Engine
    from offload_engine.generate.decoder import FinishEvent

    torch.set_num_threads(threads)
    files = checkpoint_files(model)
    evict(files)
    vocab = engine_vocab(model)
    prompt = [(1009 * i + 17) % (vocab - 300) + 300 for i in range(prompt_len)]  # ordinary tokens, no specials
    read0, start = os_read_bytes(), time.perf_counter()
    engine = Engine.open(model, budget=Budget(ram=ram) if ram else None, max_context=prompt_len + tokens + 8,
                         threads=engine_threads)
    open_s = time.perf_counter() - start
    stamps, before, finish = [], None, None
    try:
        for event in engine.stream(prompt, max_new_tokens=tokens + 1, ignore_eos=True):
            stamps.append(time.perf_counter())
            if isinstance(event, FinishEvent):
                finish = event
            elif before is None:
                before, read_decode = engine.snapshot(), os_read_bytes()
        after = engine.snapshot()
        tier = engine.compute_tier
        hits = after["hits"][tier] - before["hits"][tier]
        misses = after["misses"][tier] - before["misses"][tier]
        read_end = os_read_bytes()
        steps = [b - a for a, b in zip(stamps[:-2], stamps[1:-1])]  # decode step times (the finish event last)
        return {"open_s": open_s, "ttft_s": stamps[0] - start, "first_step_s": steps[0] if steps else None,
                "tok_s": len(steps) / sum(steps), "steady_tok_s": 1 / statistics.median(steps[2:] or steps),
                "disk_bytes_per_token": (read_end - read_decode) / max(1, len(steps)),
                "open_read_bytes": read_decode - read0, "hit_rate": hits / max(1, hits + misses),
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "page_cache_bytes": cached_bytes(files), "stats": {
                    k: finish.stats.get(k) for k in ("compute_dtype", "cpu_kernels", "threads", "peak_bytes",
                                                      "budget_bytes")}}
    finally:
        engine.close()


# ---- the peer ---------------------------------------------------------------------------------------------------
def children_read_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock * 512


def llama_row(gguf: Path, tokens: int, threads: int, repetitions: int) -> dict[str, Any]:
    from tools import llama_peer

    evict([gguf])
    read0 = children_read_bytes()
    r = llama_peer.run_bench(gguf, threads, n_gen=tokens, repetitions=repetitions, timeout=3600)
    generated = tokens * (repetitions + 1)  # llama-bench warms up with one untimed run
    return {"tok_s": r.tok_s, "steady_tok_s": r.tok_s, "samples": r.samples_tok_s, "stddev": r.tok_s_stddev,
            "disk_bytes_per_token": (children_read_bytes() - read0) / generated,
            "page_cache_bytes": cached_bytes([gguf]), "model_type": r.model_type}


def llama_ttft(gguf: Path, prompt_len: int, threads: int) -> float:
    """llama-completion from a cold page cache to its first generated token (-n 1), wall time."""
    from tools import llama_peer

    evict([gguf])
    tool = llama_peer.ensure_built() / "llama-completion"
    prompt = " ".join(["hello"] * prompt_len)
    start = time.perf_counter()
    subprocess.run([str(tool), "-m", str(gguf), "-p", prompt, "-n", "1", "--temp", "0", "-no-cnv", "--no-warmup",
                    "-t", str(threads)], capture_output=True, stdin=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


# ---- the planner and the bounds -----------------------------------------------------------------------------
def planned_tok_s(model: Path, ram: str | None, context: int) -> float | None:
    cmd = [sys.executable, "-m", "offload_engine.cli", "plan", "--model", str(model), "--probe", "--json",
           "--context", str(context)] + (["--ram", ram] if ram else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        return float(json.loads(proc.stdout)["predicted_tok_s"]["expected"])
    except (ValueError, KeyError, TypeError):
        print(f"plan failed for {model} --ram {ram}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None


def active_bytes(model: Path, cfg: dict) -> int:
    if model.is_file():
        return active_bytes_gguf(model, cfg["num_experts_per_tok"], cfg["num_experts"]).per_token
    return active_bytes_hf(model).per_token


def gguf_config(path: Path) -> dict:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    return {"num_experts": int(fields[f"{arch}.expert_count"].parts[-1][0]),
            "num_experts_per_tok": int(fields[f"{arch}.expert_used_count"].parts[-1][0])}


def bound(row: SizeRow, active: int, mem_bw: float, disk_bw: float) -> None:
    resident = active / mem_bw
    disk = (row.disk_bytes_per_token or 0.0) / disk_bw
    row.bound_s, row.bound_parts = max(resident, disk), {"resident_s": resident, "disk_s": disk,
                                                          "active_bytes": active}


# ---- the run ----------------------------------------------------------------------------------------------------
def run_engine_row(name: str, model: Path, ram: str | None, a: argparse.Namespace) -> SizeRow:
    cmd = [sys.executable, __file__, "engine-row", str(model), "--tokens", str(a.tokens), "--prompt", str(a.prompt),
           "--threads", str(a.threads), "--engine-threads", a.engine_threads] + (["--ram", ram] if ram else [])
    print(f"... {name}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row = SizeRow(name, "engine", str(model), ram)
    if proc.returncode:
        row.extra["error"] = proc.stderr.strip()[-1500:]
        return row
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for k, v in got.items():
        setattr(row, k, v) if hasattr(row, k) else row.extra.__setitem__(k, v)
    return row


def table(rows: list[SizeRow]) -> str:
    head = ("| row | tok/s | steady | first step s | open s | TTFT cold s | disk MB/tok | peak RSS GiB | "
            "page cache GiB | hits | plan tok/s | bound tok/s | x bound |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    for r in rows:
        err = r.extra.get("error")
        if err:
            lines.append(f"| {r.name} | error: {err.splitlines()[-1][:80]} |")
            continue
        bound_tok = 1 / r.bound_s if r.bound_s else None
        lines.append(" | ".join([
            f"| {r.name}", f(r.tok_s, ".2f"), f(r.steady_tok_s, ".2f"), f(r.first_step_s, ".2f"), f(r.open_s, ".1f"),
            f(r.ttft_s, ".1f"), f(None if r.disk_bytes_per_token is None else r.disk_bytes_per_token / 1e6, ".1f"),
            f(None if r.peak_rss is None else r.peak_rss / GiB, ".2f"),
            f(None if r.page_cache_bytes is None else r.page_cache_bytes / GiB, ".2f"), f(r.hit_rate, ".3f"),
            f(r.predicted_tok_s, ".2f"), f(bound_tok, ".2f"),
            f(bound_tok / r.steady_tok_s if bound_tok and r.steady_tok_s else None, ".2f")]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    one = sub.add_parser("engine-row", help="(internal) one engine row in this process; prints JSON")
    one.add_argument("model", type=Path)
    one.add_argument("--ram", default=None)
    for p in (ap, one):
        p.add_argument("--tokens", type=int, default=32)
        p.add_argument("--prompt", type=int, default=32)
        p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
        p.add_argument("--engine-threads", default="auto", help="the engine's threads setting (auto, or a count)")
    ap.add_argument("--gguf4", type=Path, help="the 4-bit GGUF (fits RAM)")
    ap.add_argument("--gguf8", type=Path, help="the 8-bit GGUF (beyond RAM)")
    ap.add_argument("--ct", type=Path, help="the compressed-tensors int4 copy (tools/synthetic_quant.py)")
    ap.add_argument("--budgets", default="12GiB,25%", help="the engine's --ram on the 8-bit file")
    ap.add_argument("--repetitions", type=int, default=3, help="llama-bench -r")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-plan", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench-out/bench-size.json"))
    a = ap.parse_args(argv)
    if a.cmd == "engine-row":
        print(json.dumps(engine_row(a.model, a.ram, a.prompt, a.tokens, a.threads, a.engine_threads)))
        return 0
    from offload_engine.probe import measure_direct_read_bandwidth
    from tools.bench_physical import measure_memory_read_bandwidth

    mem = measure_memory_read_bandwidth(threads=a.threads)
    rows: list[SizeRow] = []
    plans: list[tuple[str, Path, str | None]] = []
    if a.gguf4:
        plans.append((f"engine {a.gguf4.name}, no budget flags", a.gguf4, None))
    if a.ct:
        plans.append((f"engine {a.ct.name} (ct-int4), no budget flags", a.ct, None))
    if a.gguf8:
        plans += [(f"engine {a.gguf8.name}, --ram {b}", a.gguf8, b) for b in a.budgets.split(",")]
    disk_file = a.gguf8 or a.gguf4 or next(iter(checkpoint_files(a.ct)))
    disk = measure_direct_read_bandwidth(disk_file, 1 << 30, 4 << 20, threads=4, repeats=3)
    for name, model, ram in plans:
        row = run_engine_row(name, model, ram, a)
        cfg = gguf_config(model) if model.is_file() else json.loads((model / "config.json").read_text())
        bound(row, active_bytes(model, cfg), mem.bytes_per_s, disk.bytes_per_s)
        if not a.no_plan:
            row.predicted_tok_s = planned_tok_s(model, ram, a.prompt + a.tokens + 8)
        rows.append(row)
    if not a.no_peer:
        for gguf in (g for g in (a.gguf4, a.gguf8) if g):
            print(f"... llama.cpp {gguf.name}", file=sys.stderr, flush=True)
            row = SizeRow(f"llama.cpp {gguf.name} (llama-bench tg{a.tokens}, mmap)", "llama.cpp", str(gguf), None)
            for k, v in llama_row(gguf, a.tokens, a.threads, a.repetitions).items():
                setattr(row, k, v) if hasattr(row, k) else row.extra.__setitem__(k, v)
            row.ttft_s = llama_ttft(gguf, a.prompt, a.threads)
            bound(row, active_bytes(gguf, gguf_config(gguf)), mem.bytes_per_s, disk.bytes_per_s)
            rows.append(row)
    text = table(rows)
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"rows": [asdict(r) for r in rows], "memory_read_bytes_per_s": mem.bytes_per_s,
                                 "disk_bytes_per_s": disk.bytes_per_s, "threads": a.threads,
                                 "loadavg": os.getloadavg(), "table": text}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
