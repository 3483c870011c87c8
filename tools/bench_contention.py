#!/usr/bin/env python3
"""Decode speed on a shared CPU (issue 45): the engine and llama.cpp with the machine idle, with one busy process
per core beside them, and with three per core.

Each measurement is a fresh process started while the busy processes already run (as a user's `offload-engine
run` meets a busy machine): it opens the engine (default threads: `auto`, or a fixed count with --threads),
decodes an untimed warm-up request, then the measured one (an 8-token prompt, --tokens greedy steps), and
reports the decode rate and the thread counts its steps ran at (the stats' `threads`, `thread_choice`).
llama.cpp's `llama-bench` tgN runs on the same weights (the bench checkpoint in bf16, converted by llama.cpp's
own convert_hf_to_gguf.py: tools/llama_peer.py) with one thread per usable core; its column stays empty until
`python tools/llama_peer.py build` has run. The busy processes are Python loops in this process's session, so
they compete at the same weight. Rounds alternate: every round runs every load for every row. The table shows
medians, the spread (min-max over rounds) and each load's median as a share of the idle median; the JSON keeps
every sample with /proc/loadavg before it.

    python tools/bench_contention.py                        # bench bf16 + demo model, 3 rounds, 64 tokens
    python tools/bench_contention.py --threads auto,1,2     # the engine at fixed counts too
    python tools/bench_contention.py --models demo --rounds 5 --json bench-out/contention.json

The whole run takes ~5-10 minutes on 2 cores, most of it llama.cpp and the fixed-count rows under load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOADS = {"idle": 0, "1/core": 1, "3/core": 3}  # busy processes per usable core
PROMPT = "def quicksort(xs):"
WARM_PROMPT = "class Stack:"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


# ---- one engine measurement (a child process) ------------------------------------------------------------------
def worker(model: str, threads: str, tokens: int, dtype: str | None) -> dict[str, Any]:
    from offload_engine.api import Engine

    start = time.perf_counter()
    engine = Engine.open(model, threads=threads, **({"dtype": dtype} if dtype else {}))
    open_s = time.perf_counter() - start
    try:
        engine.generate(WARM_PROMPT, max_new_tokens=4, ignore_eos=True)
        stats = engine.generate(PROMPT, max_new_tokens=tokens + 1, ignore_eos=True).stats
    finally:
        engine.close()
    return {"tok_s": stats["decode_tok_s"], "threads": stats["threads"], "thread_choice": stats["thread_choice"],
            "open_s": open_s, "dtype": stats["dtype"]}


def run_engine(model: Path, threads: str, tokens: int, dtype: str | None, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(model), "--threads", threads,
           "--tokens", str(tokens)] + (["--dtype", dtype] if dtype else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- busy processes ------------------------------------------------------------------------------------------
class Busy:
    """n processes spinning in Python, in this session (same scheduling weight as the measured process)."""

    def __init__(self, n: int):
        self.procs = [subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"]) for _ in range(n)]
        time.sleep(0.3 if n else 0.0)  # running before the measured process starts

    def __enter__(self) -> "Busy":
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


# ---- the rows --------------------------------------------------------------------------------------------------
def bench_model(work: Path) -> Path:
    """tools/bench.py's bench checkpoint in bf16 (tools/bench_formats.build's cache layout), built if missing."""
    from tools.bench_formats import build

    return build("bf16", "qwen3_moe", "bench", work / "formats")


def llama_gguf(model: Path, work: Path) -> Path | None:
    """The bench checkpoint as llama.cpp's BF16 GGUF (tools/bench_llama.py's path), where llama.cpp is built."""
    from tools import llama_peer

    if llama_peer.built() is None:
        return None
    return llama_peer.convert(model, work / "formats" / "gguf" / "qwen3_moe-bench-BF16.gguf", "bf16")


def rows_of(args: argparse.Namespace) -> list[dict[str, Any]]:
    """(label, how to measure one sample) for every row the run compares."""
    from offload_engine.defaults import PACKAGE_MODEL

    rows = []
    for name in args.models:
        model, dtype = (bench_model(Path(args.work_dir)), "bfloat16") if name == "bench" else (PACKAGE_MODEL, None)
        for threads in args.threads:
            rows.append({"model": name, "system": f"engine threads={threads}", "kind": "engine", "path": str(model),
                         "threads": threads, "dtype": dtype})
        if name == "bench" and not args.no_peer:
            gguf = llama_gguf(model, Path(args.work_dir))
            if gguf is not None:
                rows.append({"model": name, "system": f"llama.cpp BF16 -t {usable_cores()}", "kind": "llama",
                             "path": str(gguf), "tokens": args.peer_tokens})
            else:
                print("llama.cpp is not built (python tools/llama_peer.py build): no peer row", file=sys.stderr)
    return rows


def measure(row: dict[str, Any], tokens: int, timeout: float) -> dict[str, Any]:
    if row["kind"] == "engine":
        return run_engine(Path(row["path"]), row["threads"], tokens, row["dtype"], timeout)
    from tools.llama_peer import run_bench

    result = run_bench(row["path"], threads=usable_cores(), n_gen=row["tokens"], repetitions=1, timeout=timeout)
    return {"tok_s": result.tok_s, "threads": result.threads, "build_commit": result.build_commit}


# ---- report ----------------------------------------------------------------------------------------------------
def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [s["tok_s"] for s in samples]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "n": len(rates)}


def threads_used(samples: list[dict[str, Any]]) -> str:
    """The counts the engine's decode steps ran at over a cell's samples, e.g. '1' or '1-2'."""
    counts = sorted({int(k) for s in samples for k, v in (s.get("thread_choice") or {}).get("tokens_by_threads", {})
                     .items() if v} | {s["threads"] for s in samples if "thread_choice" not in s})
    return "-".join(str(c) for c in (counts[0], counts[-1])) if len(counts) > 1 else (str(counts[0]) if counts else "")


def table(result: dict[str, Any]) -> str:
    head = f"{'model':<6} {'system':<20}" + "".join(f" {load + ' tok/s (min-max)':>26} {'/idle':>5} {'thr':>4}"
                                                    for load in result["loads"])
    lines = [head, "-" * len(head)]
    for row in result["rows"]:
        cells, idle = "", row["cells"].get("idle", {}).get("median")
        for load in result["loads"]:
            cell = row["cells"].get(load)
            if not cell:
                cells += f" {'-':>26} {'':>5} {'':>4}"
                continue
            share = f"{cell['median'] / idle:.2f}" if idle else ""
            spread = f"{cell['median']:.1f} ({cell['min']:.1f}-{cell['max']:.1f})"
            cells += f" {spread:>26} {share:>5} {cell['threads_used']:>4}"
        lines.append(f"{row['model']:<6} {row['system']:<20}{cells}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bench,demo", help="bench (bf16 bench checkpoint), demo (bundled model)")
    ap.add_argument("--threads", default="auto", help="the engine's --threads values, one row each (auto,1,2)")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"of {', '.join(LOADS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps measured")
    ap.add_argument("--work-dir", default="bench-out", help="checkpoints and GGUFs (tools/bench.py's)")
    ap.add_argument("--no-peer", action="store_true", help="no llama.cpp row")
    ap.add_argument("--peer-tokens", type=int, default=32,
                    help="llama-bench tgN (it fell to 0.5 tok/s beside one busy process per core)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one sample may take")
    ap.add_argument("--json", default=None, help="write every sample here (default: WORK_DIR/contention.json)")
    ap.add_argument("--worker", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.threads = [t for t in args.threads.split(",") if t]
    args.loads = [x for x in args.loads.split(",") if x]
    bad = [m for m in args.models if m not in ("bench", "demo")] + [x for x in args.loads if x not in LOADS]
    if bad:
        ap.error(f"unknown model or load {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads[0], args.tokens, args.dtype)))
        return 0
    rows = rows_of(args)
    samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
    cores = usable_cores()
    for r in range(args.rounds):
        for load in args.loads:
            with Busy(LOADS[load] * cores):
                for i, row in enumerate(rows):
                    before = loadavg()
                    sample = {**measure(row, args.tokens, args.timeout), "round": r, "loadavg_before": before}
                    samples.setdefault((i, load), []).append(sample)
                    print(f"round {r + 1}/{args.rounds} {load:>6} {row['model']} {row['system']}: "
                          f"{sample['tok_s']:.1f} tok/s, threads {sample['threads']} (loadavg {before})",
                          file=sys.stderr, flush=True)
    result = {"cores": cores, "tokens": args.tokens, "rounds": args.rounds, "loads": args.loads,
              "busy_per_core": {load: LOADS[load] for load in args.loads}, "rows": []}
    for i, row in enumerate(rows):
        cells = {load: {**summarize(samples[(i, load)]), "threads_used": threads_used(samples[(i, load)]),
                        "samples": samples[(i, load)]} for load in args.loads}
        result["rows"].append({**row, "cells": cells})
    print(table(result))
    out = Path(args.json or Path(args.work_dir) / "contention.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
