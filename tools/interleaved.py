#!/usr/bin/env python3
"""A resident engine and a budgeted one in one process, the same prompts alternated between them: what the budget
costs per decode token when both see the same machine phase (this VM's speed drifts by 20% within minutes).

  python tools/interleaved.py [--model bench-out/bench-model] [--budget 25%] [--rounds 2] [--json FILE]

Per pair: decode ms/token of each, the main thread's CPU ms/token of each, the budgeted engine's I/O stall and
misses. Then the split of the CPU: time inside the expert matmuls (`expert_part`) per call for each engine, and
for the budgeted one, with and without a disk read in flight. docs/PERF.md (session 11) has a run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import offload_engine.runtime.model as model_module  # noqa: E402
from offload_engine import Budget, Engine  # noqa: E402
from offload_engine.generate.decoder import FinishEvent  # noqa: E402

PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400, 500, 600, 700, 800], [42] * 8,
           [9, 99, 999, 8000, 5, 55, 555, 5555])


class ExpertClock:
    """Thread CPU time inside runtime.model's expert_part, by (engine, reads in flight or not)."""

    def __init__(self):
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.engine: Engine | None = None
        self.name = ""
        self._inner = model_module.expert_part
        model_module.expert_part = self._timed

    def _timed(self, *args):
        busy = self.engine.store.stats.read_busy.active if self.engine is not None else 0
        key = (self.name, "reading" if busy else "idle")
        start = time.thread_time()
        try:
            return self._inner(*args)
        finally:
            self.seconds[key] += time.thread_time() - start
            self.calls[key] += 1

    def per_call_us(self, name: str, state: str | None = None) -> float:
        keys = [k for k in self.calls if k[0] == name and (state is None or k[1] == state)]
        calls = sum(self.calls[k] for k in keys)
        return sum(self.seconds[k] for k in keys) / calls * 1e6 if calls else 0.0


def decode(engine: Engine, prompt: list[int], tokens: int) -> dict:
    marks, stats = [], {}
    for event in engine.stream(prompt, max_new_tokens=tokens + 1, ignore_eos=True):
        if isinstance(event, FinishEvent):
            stats = event.stats
        else:
            marks.append((time.perf_counter(), time.thread_time()))
    (w0, c0), (w1, c1) = marks[0], marks[-1]  # from the first token (the prefill's) to the last
    steps = len(marks) - 1
    return {"ms": (w1 - w0) / steps * 1e3, "cpu_ms": (c1 - c0) / steps * 1e3,
            "stall_ms": stats.get("stall_s_per_token", 0.0) * 1e3,
            "misses": stats["misses"][engine.compute_tier] / len(marks)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "bench-out/bench-model")
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--direct-io", default="on", choices=["on", "off", "auto"])
    ap.add_argument("--prefetch", default="off", choices=["off", "adaptive"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        print(f"{args.model}: no checkpoint (python tools/bench.py builds bench-out/bench-model)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.torch_threads)
    clock = ExpertClock()
    engines = {"resident": Engine.open(args.model, prefetch=False),
               args.budget: Engine.open(args.model, budget=Budget(ram=args.budget), direct_io=args.direct_io,
                                        prefetch=args.prefetch == "adaptive")}
    try:
        for name, engine in engines.items():  # warm-up, untimed
            clock.engine, clock.name = engine, f"warm-up {name}"
            engine.generate([7, 8, 9, 10, 11, 12, 13, 14], max_new_tokens=8, ignore_eos=True)
        pairs = []
        print(f"{'resident ms':>11} {'cpu':>6} | {args.budget + ' ms':>8} {'cpu':>6} {'stall':>6} {'misses':>6} | "
              f"{'ratio':>5} {'cpu +':>6}")
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                row = {}
                for name, engine in engines.items():
                    clock.engine, clock.name = engine, name
                    row[name] = decode(engine, prompt, args.tokens)
                a, b = row["resident"], row[args.budget]
                pairs.append(row)
                print(f"{a['ms']:11.1f} {a['cpu_ms']:6.1f} | {b['ms']:8.1f} {b['cpu_ms']:6.1f} {b['stall_ms']:6.1f} "
                      f"{b['misses']:6.1f} | {b['ms'] / a['ms']:5.2f} {b['cpu_ms'] - a['cpu_ms']:+6.1f}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    ratios = [p[args.budget]["ms"] / p["resident"]["ms"] for p in pairs]
    summary = {
        "ratio_median": statistics.median(ratios), "ratio_mean": statistics.mean(ratios),
        "cpu_extra_ms": statistics.mean(p[args.budget]["cpu_ms"] - p["resident"]["cpu_ms"] for p in pairs),
        "stall_ms": statistics.mean(p[args.budget]["stall_ms"] for p in pairs),
        "expert_us": {"resident": clock.per_call_us("resident"), args.budget: clock.per_call_us(args.budget),
                      f"{args.budget} reading": clock.per_call_us(args.budget, "reading"),
                      f"{args.budget} idle": clock.per_call_us(args.budget, "idle")}}
    print(f"ratio median {summary['ratio_median']:.3f} mean {summary['ratio_mean']:.3f}; "
          f"CPU {summary['cpu_extra_ms']:+.1f} ms/token, stall {summary['stall_ms']:.1f} ms/token; "
          "expert_part us/call: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["expert_us"].items()))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "pairs": pairs,
                                         "summary": summary}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
