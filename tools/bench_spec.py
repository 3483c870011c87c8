#!/usr/bin/env python3
"""Speculative decoding benchmark: decode tok/s of each --spec mode against --spec off, at one budget.

Every run opens a fresh engine (same cold store), decodes greedily, and checks the tokens equal --spec off's.
Runs are interleaved (off, auto, ngram, ... then again) so that machine-load drift hits every mode alike; the
table reports the median decode tok/s over the repeats and its ratio to off, the same from process CPU time
(decode tokens per CPU-second: steady on a shared machine, but blind to time spent waiting for reads, which
the bytes read per token show), acceptance, target forwards and bytes read from disk per token.

    python tools/bench_spec.py --model .cache/ds-offload-mtp --budget 25% --specs off,auto,ngram,mtp,self --out spec.json
    python tools/bench_spec.py --make deepseek_v3:offload:mtp=1 --budget 25% --prompt code --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_engine import Budget, Engine  # noqa: E402
from offload_engine.generate.decoder import FinishEvent  # noqa: E402

PROMPTS = {
    # repetitive code: what n-gram lookup is for
    "code": ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
             "    return a * b\n\n\ndef div(a, b):\n    return a / b\n\n\n"
             "def add3(a, b, c):\n    return a + b + c\n\n\n"
             "def sub3(a, b, c):\n    return a - b - c\n\n\ndef mul3(a, b, c):\n"),
    "prose": "The file is opened, read line by line, and each line is split on commas into fields that",
}


def open_engine(path: Path, budget: Budget, spec: str, depth: int | None, width: int | None,
                draft_path: Path | None, context: int = 512) -> Engine:
    """Opened as a user would: Engine.open(spec=...)."""
    draft = {"draft_model": draft_path} if draft_path and spec in ("draft", "auto") else {}
    return Engine.open(path, budget=budget, max_context=context, spec=spec, spec_depth=depth, spec_width=width,
                       **draft)


def run_once(path: Path, budget: Budget, spec: str, prompt: str, tokens: int, depth: int | None,
             width: int | None, draft_path: Path | None, context: int = 512) -> dict:
    """One fresh engine (cold store), one greedy request."""
    with open_engine(path, budget, spec, depth, width, draft_path, context) as engine:
        return measure(engine, spec, prompt, tokens)


def measure(engine: Engine, spec: str, prompt: str, tokens: int) -> dict:
    """One greedy request on an open engine."""
    cpu_first, finish = None, None
    for event in engine.stream(prompt, max_new_tokens=tokens, ignore_eos=True):
        if cpu_first is None:  # the first token comes from prefill: decode CPU time starts here
            cpu_first = time.process_time()
        if isinstance(event, FinishEvent):
            finish = event
    cpu = time.process_time() - cpu_first
    st, n = finish.stats, len(finish.token_ids)
    return {"spec": spec, "tokens": finish.token_ids, "decode_tok_s": st["decode_tok_s"],
            "cpu_tok_s": (n - 1) / cpu if cpu > 0 else 0.0,
            "bytes_read_disk_per_token": st["bytes_read_disk_per_token"], "mean_accepted": st["mean_accepted"],
            "accept_hist": st["accept_hist"], "target_forwards": st["target_forwards"],
            "spec_steps": st["spec_steps"], "by_drafter": st["by_drafter"]}


def make(spec: str, cache_dir: Path) -> Path:
    """'arch:preset[:key=value...]' -> a checkpoint folder under cache_dir (built once)."""
    from tools.make_checkpoint import make_checkpoint

    arch, preset, *opts = spec.split(":")
    options = {k: int(v) if v.isdigit() else v for k, v in (o.split("=") for o in opts)}
    out = cache_dir / spec.replace(":", "-").replace("=", "")
    if not (out / "config.json").exists():
        make_checkpoint(arch, preset, out, force=True, **options)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="checkpoint folder")
    src.add_argument("--make", help="build a test checkpoint: arch:preset[:mtp=1] (cached in --cache)")
    ap.add_argument("--cache", type=Path, default=Path(".cache/bench-spec"))
    ap.add_argument("--budget", default="25%", help="--ram budget (default 25%% of the model)")
    ap.add_argument("--specs", default="off,auto,ngram,mtp,self", help="comma-separated modes (off is always run)")
    ap.add_argument("--draft-model", type=Path, default=None)
    ap.add_argument("--prompt", default="code", help=f"one of {sorted(PROMPTS)} or literal text")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="KV cache positions reserved (in the budget)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warm", action="store_true",
                    help="one engine per mode, kept open: a warm-up request (another prompt), then the repeats on "
                         "the same engine (a server's steady state; default: a fresh engine per run, as the CLI)")
    ap.add_argument("--spec-depth", type=int, default=None)
    ap.add_argument("--spec-width", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    ap.add_argument("--out", type=Path, default=Path("bench-spec.json"), help="JSON written here too")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    path = a.model or make(a.make, a.cache)
    prompt = PROMPTS.get(a.prompt, a.prompt)
    specs = ["off"] + [s for s in a.specs.split(",") if s and s != "off"]
    runs: dict[str, list[dict]] = {s: [] for s in specs}
    engines: dict[str, Engine | Exception] = {}
    if a.warm:
        for s in specs:
            try:
                engines[s] = open_engine(path, Budget(ram=a.budget), s, a.spec_depth, a.spec_width, a.draft_model,
                                         a.context)
                measure(engines[s], s, PROMPTS["prose"], 16)
            except Exception as e:
                engines[s] = e
    try:
        for _ in range(a.repeat):
            for s in specs:
                try:
                    if isinstance(engines.get(s), Exception):
                        raise engines[s]
                    runs[s].append(measure(engines[s], s, prompt, a.tokens) if a.warm else
                                   run_once(path, Budget(ram=a.budget), s, prompt, a.tokens, a.spec_depth,
                                            a.spec_width, a.draft_model, a.context))
                except Exception as e:  # a mode this checkpoint does not support (e.g. mtp without MTP layers)
                    runs[s].append({"spec": s, "error": f"{type(e).__name__}: {e}"})
    finally:
        for engine in engines.values():
            if isinstance(engine, Engine):
                engine.close()
    if any("error" in r for r in runs["off"]):
        print(f"error: --spec off failed: {runs['off'][0].get('error')}", file=sys.stderr)
        return 1
    base = statistics.median(r["decode_tok_s"] for r in runs["off"])
    base_cpu = statistics.median(r["cpu_tok_s"] for r in runs["off"])
    reference = runs["off"][0]["tokens"]
    rows = []
    for s in specs:
        ok = [r for r in runs[s] if "error" not in r]
        if not ok:
            rows.append({"spec": s, "error": runs[s][0]["error"]})
            continue
        tps = statistics.median(r["decode_tok_s"] for r in ok)
        cpu = statistics.median(r["cpu_tok_s"] for r in ok)
        rows.append({"spec": s, "decode_tok_s": round(tps, 2), "vs_off": round(tps / base, 3),
                     "cpu_tok_s": round(cpu, 2), "cpu_vs_off": round(cpu / base_cpu, 3),
                     "identical": all(r["tokens"] == reference for r in ok),
                     "mean_accepted": round(statistics.mean(r["mean_accepted"] for r in ok), 3),
                     "spec_steps": int(statistics.median(r["spec_steps"] for r in ok)),
                     "target_forwards": int(statistics.median(r["target_forwards"] for r in ok)),
                     "bytes_read_disk_per_token": int(statistics.median(r["bytes_read_disk_per_token"] for r in ok)),
                     "all_tok_s": [round(r["decode_tok_s"], 2) for r in ok]})
    report = {"model": str(path), "budget": a.budget, "prompt": a.prompt, "tokens": a.tokens, "repeat": a.repeat,
              "warm": a.warm, "rows": rows}
    a.out.write_text(json.dumps(report, indent=2))
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{path.name}  budget {a.budget}  prompt {a.prompt!r}  {a.tokens} tokens  median of {a.repeat}"
          f"{'  warm engines' if a.warm else ''}")
    print(f"{'spec':<7}{'tok/s':>8}{'vs off':>8}{'cpu tok/s':>11}{'vs off':>8}{'same':>6}{'acc/step':>10}"
          f"{'spec steps':>12}{'fwd':>5}{'disk B/tok':>12}   runs (tok/s)")
    for r in rows:
        if "error" in r:
            print(f"{r['spec']:<7}  {r['error']}")
            continue
        print(f"{r['spec']:<7}{r['decode_tok_s']:>8.2f}{r['vs_off']:>8.2f}{r['cpu_tok_s']:>11.2f}"
              f"{r['cpu_vs_off']:>8.2f}{str(r['identical']):>6}{r['mean_accepted']:>10.2f}{r['spec_steps']:>12}{r['target_forwards']:>5}"
              f"{r['bytes_read_disk_per_token']:>12}   {r['all_tok_s']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
