#!/usr/bin/env python3
"""Weight formats against each other: the bench checkpoint in fp32, bf16, fp8 blocks, int8 and int4, each run by
the engine at the same RAM budget (25% of its own bytes by default), decode tok/s, MB read per token, hit rate.

Bytes are what the engine moves: a format with k times fewer bytes per unit should read k times fewer bytes per
token at the same hit rate, and decode faster where reads or memory bandwidth bound it. The checkpoints are
tools/make_checkpoint.py's bench checkpoint (tools/bench.py's: qwen3_moe, preset bench) in fp32 and bf16, and
the bf16 one written by --quant fp8-block / ct-int8 / ct-int4; each is built once into --cache-dir and reused.
The engine runs are tools/bench.py's run_engine (an untimed warm-up request, then the measured one; O_DIRECT
below 100%), `--rounds` times per format, interleaved over the formats; the table shows the median round.

    python tools/bench_formats.py                                   # the bench checkpoint, 25%, ~6 GB in the cache
    python tools/bench_formats.py --quick --cache-dir /tmp/bf       # tiny checkpoint, 4 tokens (smoke run)
    python tools/bench_formats.py --same-bytes                      # every format at 25% of the bf16 bytes
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_engine.checkpoint.model import open_model  # noqa: E402
from offload_engine.probe import machine_info  # noqa: E402
from tools.bench import run_engine, source_state, versions  # noqa: E402
from tools.bench_common import EngineRun, prompt_ids  # noqa: E402

FORMATS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "fp8-block": ("bfloat16", "fp8-block"),
           "ct-int8": ("bfloat16", "ct-int8"), "ct-int4": ("bfloat16", "ct-int4")}  # name: (dtype, --quant)
MB = 1e6


def build(fmt: str, arch: str, preset: str, cache: Path, rebuild: bool = False) -> Path:
    """The checkpoint of `fmt` in the cache (built by tools/make_checkpoint.py when missing)."""
    from tools.make_checkpoint import make_checkpoint

    dtype, quant = FORMATS[fmt]
    out = cache / f"{arch}-{preset}-{fmt}"
    if rebuild or not (out / "config.json").is_file():  # make_checkpoint publishes a finished folder only
        make_checkpoint(arch, preset, out, dtype=dtype, quant=quant, force=True)
    return out


def unit_bytes(model: Path) -> dict[str, Any]:
    """The unit sizes the store moves (checkpoint/layout.py's blobs): the largest per kind and the total."""
    ck = open_model(model)
    largest: dict[str, int] = {}
    for key, layout in ck.layouts.items():
        largest[key.kind] = max(largest.get(key.kind, 0), layout.nbytes)
    quant = ck.quant.method if ck.quant else None
    return {"total": ck.total_bytes, "largest": largest, "quant_method": quant, "dtype": ck.spec.dtype,
            "vocab": ck.spec.vocab_size}


def median_run(runs: list[EngineRun]) -> EngineRun:
    return sorted(runs, key=lambda r: r.tok_s)[(len(runs) - 1) // 2]


def rows_of(formats: list[str], info: dict[str, dict], runs: dict[str, list[EngineRun]]) -> list[dict[str, Any]]:
    """One row per format, with bf16 as the reference of the ratios (when it was run)."""
    rows = []
    for fmt in formats:
        r = median_run(runs[fmt])
        rows.append({"format": fmt, "bytes_total": info[fmt]["total"], "unit_bytes": info[fmt]["largest"],
                     "quant_method": info[fmt]["quant_method"], "decode_tok_s": r.tok_s,
                     "mb_read_per_token": r.bytes_read_disk_per_token / MB, "hit_rate": r.hit_rate,
                     "all_tok_s": [x.tok_s for x in runs[fmt]], "engine": asdict(r)})
    ref = next((row for row in rows if row["format"] == "bf16"), None)
    for row in rows:
        e = row["engine"]
        row["size_vs_bf16"] = row["bytes_total"] / ref["bytes_total"] if ref else None
        row["bytes_per_token_vs_bf16"] = (e["bytes_read_disk_per_token"] / ref["engine"]["bytes_read_disk_per_token"]
                                          if ref and ref["engine"]["bytes_read_disk_per_token"] else None)
        row["speed_vs_bf16"] = row["decode_tok_s"] / ref["decode_tok_s"] if ref else None
        row["tokens_same_as_bf16"] = (_same_prefix(e["tokens"], ref["engine"]["tokens"]) if ref else None)
    return rows


def _same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'format':<10} {'MB':>8} {'size':>6} {'expert':>9} {'tok/s':>8} {'speed':>6} {'MB/tok':>8} "
             f"{'bytes/tok':>9} {'hits':>6} {'same':>5}",
             f"{'':<10} {'':>8} {'/bf16':>6} {'unit KB':>9} {'':>8} {'/bf16':>6} {'read':>8} {'/bf16':>9} "
             f"{'%':>6} {'toks':>5}"]
    for r in rows:
        expert = r["unit_bytes"].get("expert")
        lines.append(f"{r['format']:<10} {r['bytes_total'] / MB:>8.1f} {_f(r['size_vs_bf16'], '6.3f'):>6} "
                     f"{_f(expert and expert / 1e3, '9.1f'):>9} {r['decode_tok_s']:>8.2f} "
                     f"{_f(r['speed_vs_bf16'], '6.2f'):>6} {r['mb_read_per_token']:>8.2f} "
                     f"{_f(r['bytes_per_token_vs_bf16'], '9.3f'):>9} {100 * r['hit_rate']:>6.1f} "
                     f"{_f(r['tokens_same_as_bf16'], 'd'):>5}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, from {','.join(FORMATS)}")
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--preset", default="bench", help="tools/make_checkpoint.py preset (default bench, as bench.py)")
    ap.add_argument("--cache-dir", type=Path, default=Path("bench-out/formats"), help="built checkpoints (reused)")
    ap.add_argument("--rebuild", action="store_true", help="build the checkpoints again")
    ap.add_argument("--budget", type=float, default=25.0, help="RAM budget, %% of each checkpoint's bytes")
    ap.add_argument("--same-bytes", action="store_true",
                    help="the same byte budget for every format: --budget %% of the bf16 checkpoint's bytes")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps (after the prefill's token)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="engine runs per format, interleaved (median shown)")
    ap.add_argument("--prefetch", default="adaptive", choices=("off", "on", "adaptive"))
    ap.add_argument("--json", type=Path, help="results file (default: CACHE_DIR/bench-formats.json)")
    ap.add_argument("--quick", action="store_true", help="smoke run: preset offload, 4 tokens, 1 round")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    a = ap.parse_args(argv)
    if a.quick:
        a.preset, a.tokens, a.prompt_len, a.rounds = "offload", 4, 4, 1
    a.formats = [f for f in a.formats.split(",") if f]
    unknown = [f for f in a.formats if f not in FORMATS]
    if unknown or not a.formats:
        ap.error(f"--formats: expected names from {','.join(FORMATS)}, got {','.join(unknown) or 'none'}")
    if a.rounds < 1 or a.tokens < 1 or not 0 < a.budget <= 100:
        ap.error("--rounds and --tokens must be >= 1 and --budget in (0, 100]")
    if a.same_bytes and "bf16" not in a.formats:
        ap.error("--same-bytes needs bf16 in --formats (its bytes set the budget)")
    a.json = a.json or a.cache_dir / "bench-formats.json"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    started = time.time()
    a.cache_dir.mkdir(parents=True, exist_ok=True)
    models = {fmt: build(fmt, a.arch, a.preset, a.cache_dir, a.rebuild) for fmt in a.formats}
    info = {fmt: unit_bytes(m) for fmt, m in models.items()}
    vocab = info[a.formats[0]]["vocab"]
    prompt, warm = prompt_ids(a.prompt_len, vocab), prompt_ids(a.prompt_len, vocab, 1)
    ram = {fmt: int(info["bf16"]["total"] * a.budget / 100) if a.same_bytes else None for fmt in a.formats}
    runs: dict[str, list[EngineRun]] = {fmt: [] for fmt in a.formats}
    for i in range(a.rounds):  # interleaved: a drift of the machine's speed hits every format alike
        for fmt in a.formats:
            if a.progress:
                print(f"round {i + 1}/{a.rounds}: {fmt}", file=sys.stderr)
            runs[fmt].append(run_engine(models[fmt], a.budget, prompt, warm, a.tokens, False, prefetch=a.prefetch,
                                        ram=ram[fmt]))
    rows = rows_of(a.formats, info, runs)
    print(f"{a.arch}/{a.preset} at {a.budget:g}% of {'the bf16 checkpoint' if a.same_bytes else 'each'}'s bytes, "
          f"{a.tokens} tokens, median of {a.rounds}")
    print(table(rows))
    result = {"command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
              "duration_s": time.time() - started, "machine": machine_info(), "versions": versions(),
              "engine_source": source_state(),
              "settings": {"arch": a.arch, "preset": a.preset, "budget_pct": a.budget, "same_bytes": a.same_bytes,
                           "tokens": a.tokens, "prompt_len": a.prompt_len, "rounds": a.rounds,
                           "prefetch": a.prefetch, "prompt": prompt},
              "models": {fmt: str(m) for fmt, m in models.items()}, "rows": rows}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
