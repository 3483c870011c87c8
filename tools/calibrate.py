#!/usr/bin/env python3
"""Calibrate the planner against the engine on this machine, in one command:

    python tools/calibrate.py                          # probe, bench checkpoint, budgets 100,25,10, compare
    python tools/calibrate.py --tokens 4 --quick       # a smoke run: quick probe, 4 decode steps per budget
    python tools/calibrate.py --hardware prof.json     # reuse a profile instead of probing
    python tools/calibrate.py --markdown               # also print the table of docs/CALIBRATION.md

1. Probe: `offload-engine probe` (planner.hardware.probe), its scratch file in --work-dir, the disk that holds the
   checkpoint; the profile is written to WORK_DIR/profile.json.
2. The bench checkpoint: `tools/make_checkpoint.py --arch qwen3_moe --preset bench` (float32, ~2.6 GB), built
   once in WORK_DIR/bench-model (or --model DIR).
3. The engine at each budget (% of the checkpoint's bytes: --ram on a CPU, --vram on CUDA with RAM unlimited),
   direct I/O on: an untimed warm-up request, then a measured one of --tokens decode steps. Decode tok/s, the
   compute tier's hit rate and the prefetcher's recall count decode steps only; the CPU time other processes
   took during them is recorded (`others_cpu`, cores): above 0.25 the point is marked as contended.
4. The planner for the same budget, context, position, direct I/O and effective prefetch recall
   (frontend/calibrate.calibrate, the code behind `tools/plan.py --calibrate`), its expected hit rates from a routing
   trace of the model over two requests on other prompts (--trace-tokens; the planner's `--trace`, replayed
   through per-layer caches), and again with the engine's measured hit rate. The issue's check: predicted within +-25% of measured.

Prints predicted vs measured with the ratio, writes --json (default WORK_DIR/calibration.json).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from offload_engine import Budget, Engine  # noqa: E402
from offload_engine.errors import OffloadEngineError  # noqa: E402
from offload_engine.frontend import calibrate as calibration  # noqa: E402
from offload_engine.planner.hardware import load_profile, probe, save_profile  # noqa: E402
from offload_engine.probe import Meter  # noqa: E402
from offload_engine.generate.decoder import FinishEvent  # noqa: E402
from tools.trace_experts import routing_trace  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tools/calibrate.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default="bench-out",
                    help="checkpoint (shared with tools/bench.py), profile, results (default %(default)s)")
    ap.add_argument("--model", help="a checkpoint folder (default: build the bench checkpoint in --work-dir)")
    ap.add_argument("--hardware", help="a profile NAME or FILE instead of probing this machine")
    ap.add_argument("--quick", action="store_true", help="quick probe (256 MiB read, small matmuls)")
    ap.add_argument("--budgets", default="100,25,10", help="budgets, %% of the checkpoint (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps measured per budget (default %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--trace-tokens", type=int, default=32, metavar="N",
                    help="record the model's routing over two requests of N tokens on other prompts and predict hit "
                         "rates from it (default 32; 0: use --alpha instead)")
    ap.add_argument("--alpha", type=float, default=1.0,
                    help="locality for the prediction with --trace-tokens 0 (1: uniform routing)")
    ap.add_argument("--threads", type=int, default=0, metavar="N",
                    help="torch threads for the probe and the engine (default: torch's; 1 is steadier on a shared "
                         "machine, where multi-threaded ops stall whenever a core is taken away)")
    ap.add_argument("--json", help="results file (default WORK_DIR/calibration.json)")
    ap.add_argument("--markdown", action="store_true", help="also print the docs/CALIBRATION.md table")
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.prompt_len < 1:
        ap.error("--tokens must be >= 2 and --prompt-len >= 1")
    return args


def ensure_model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from tools.make_checkpoint import make_checkpoint

    out = Path(args.work_dir) / "bench-model"
    if not (out / "config.json").is_file():
        print(f"building the bench checkpoint in {out} (once)...", file=sys.stderr)
        make_checkpoint("qwen3_moe", "bench", out, dtype="float32", force=True)
    return out


def ensure_profile(args: argparse.Namespace) -> Any:
    if args.hardware:
        return load_profile(args.hardware)
    print(f"probing this machine (scratch file in {args.work_dir})...", file=sys.stderr)
    prof = probe(args.work_dir, name=f"{platform.node() or 'this-machine'}-probe",
                 read_bytes=(256 << 20) if args.quick else (1 << 30), quick=args.quick)
    save_profile(prof, Path(args.work_dir) / "profile.json")
    return prof


def prompt_ids(n: int, vocab: int, salt: int) -> list[int]:
    return [(7919 * (i + 1) + 104729 * salt) % (vocab - 2) + 1 for i in range(n)]


def record_trace(model: Path, prompts: list[list[int]], tokens: int) -> dict:
    """The model's routing over consecutive requests on other prompts: the planner's expected hit rates then
    come from replaying it through the per-layer caches, cache churn from one prompt to the next included (the
    measured request follows a warm-up request on another prompt)."""
    print(f"routing trace ({len(prompts)} requests of {tokens} tokens)...", file=sys.stderr)
    return routing_trace(model, prompts, tokens, max(len(p) for p in prompts) + tokens + 8)


def run_engine(model: Path, pct: float, tier: str, prompt: list[int], warm: list[int], steps: int) -> dict:
    """One engine at one budget: a warm-up request, then a measured one (decode steps only)."""
    budget = Budget(vram=f"{pct:g}%") if tier == "vram" else Budget(ram=f"{pct:g}%")
    engine = Engine.open(model, budget=budget, max_context=len(prompt) + steps + 8, direct_io="on")
    try:
        # as long as the measured request: the expert caches start empty, and the plan predicts a warm cache
        engine.generate(warm, max_new_tokens=steps + 1, ignore_eos=True)
        meter, compute = Meter(), engine.compute_tier
        before = finish = None
        for event in engine.stream(prompt, max_new_tokens=steps + 1, ignore_eos=True):
            if isinstance(event, FinishEvent):
                meter.stop()
                finish = event
            elif before is None:  # the prefill's token: decode starts here
                before = engine.snapshot()
                meter.start()
        after, stats = engine.snapshot(), finish.stats
        hits = after["hits"][compute] - before["hits"][compute]
        misses = after["misses"][compute] - before["misses"][compute]
        n = len(finish.token_ids) - 1
        return {"budget_pct": pct, "tier": tier, "decode_steps": n, "decode_s": stats["decode_s"],
                "tok_s": n / stats["decode_s"], "hit_rate": hits / max(hits + misses, 1),
                "bytes_read_disk_per_token": (after["bytes_read_disk"] - before["bytes_read_disk"]) / n,
                "prefetch": stats.get("prefetch") or {}, "direct_io": engine.store.direct_io,
                "others_cpu": meter.others_cpu, "cpu_util": meter.cpu_util,
                "peak_bytes": stats["peak_bytes"], "budget_bytes": stats["budget_bytes"]}
    finally:
        engine.close()
        del engine
        gc.collect()


def markdown(rows: list[dict], profile, model: str, loadavg: tuple) -> str:
    out = [f"Model `{model}`, profile `{profile.name}` ({profile.describe()}); load average at the end "
           f"{loadavg[0]:.2f} / {loadavg[1]:.2f} / {loadavg[2]:.2f}.", "",
           "| budget | measured tok/s | predicted tok/s | ratio | within +-25% | predicted with measured hits | "
           "other processes (cores) | bottleneck |", "|---|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        w = r.get("predicted_with_measured_hits")
        others = r.get("others_cpu")
        out.append(f"| {r['budget_pct']:g}% | {r['measured_tok_s']:.2f} | {r['predicted_tok_s']:.2f} | "
                   f"{r['ratio']:.2f} | {'yes' if r['within_25pct'] else 'no'} | "
                   f"{'-' if w is None else f'{w:.2f}'} | {'-' if others is None else f'{others:.2f}'} | "
                   f"{r['bottleneck']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    try:
        profile = ensure_profile(args)
        model = ensure_model(args)
        config = json.loads((model / "config.json").read_text())
        tier = "vram" if torch.cuda.is_available() else "ram"
        prompt = prompt_ids(args.prompt_len, config["vocab_size"], 0)
        warm = prompt_ids(args.prompt_len, config["vocab_size"], 1)
        trace = record_trace(model, [prompt_ids(args.prompt_len, config["vocab_size"], salt) for salt in (2, 3)],
                             args.trace_tokens) if args.trace_tokens else None
        runs = []
        for pct in (float(b) for b in args.budgets.split(",")):
            print(f"engine at {pct:g}% ({tier})...", file=sys.stderr)
            runs.append(run_engine(model, pct, tier, prompt, warm, args.tokens))
        bench = {"model": {"path": str(model)}, "settings": {"prompt_len": args.prompt_len, "tokens": args.tokens},
                 "rows": [{"budget_pct": r["budget_pct"], "engine": r} for r in runs]}
        rows, table = calibration.calibrate(bench, str(model), profile, args.alpha, trace)
    except OffloadEngineError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    loadavg = os.getloadavg()
    print(table)
    print(f"load average at the end: {loadavg[0]:.2f} {loadavg[1]:.2f} {loadavg[2]:.2f} on {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads")
    if args.markdown:
        print("\n" + markdown(rows, profile, str(model), loadavg))
    result = {"command": " ".join([sys.executable, *sys.argv]), "duration_s": round(time.time() - started, 1),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)), "loadavg_end": loadavg,
              "cpus": os.cpu_count(), "profile": profile.to_dict(), "model": str(model), "tier": tier,
              "settings": bench["settings"] | {"alpha": args.alpha, "trace_tokens": args.trace_tokens, "direct_io": "on",
                                               "torch_threads": torch.get_num_threads()}, "engine": runs,
              "rows": rows, "all_within_25pct": all(r["within_25pct"] for r in rows)}
    path = Path(args.json or Path(args.work_dir) / "calibration.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
