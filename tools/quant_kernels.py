#!/usr/bin/env python3
"""The fast kernels for quantized weights (runtime/kernels) against the dequantize path, on this machine's CPU.

  perplexity  the bundled demo model quantized to ct-int4 and ct-int8, both per output channel, by
              tools/quant_writers.py (the demo's kv_b_proj has 48 inputs, which groups of 32 do not divide), held-out perplexity (tools/eval_demo.py's files and 128-token windows)
              with --kernels dequantize and auto: the issue asks the fast path within 1%
  decode      decode tok/s of a ct-int4 and a ct-int8 checkpoint fully resident (the bench-shaped checkpoint of
              --arch/--preset, quantized once into --work), dequantize vs fast, best of --rounds

Prints a table and writes JSON (--json).

    python tools/quant_kernels.py                       # both; about 10 min on 2 cores (quantizing included)
    python tools/quant_kernels.py --skip-decode --files 4
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_engine import Engine  # noqa: E402
from tools.eval_demo import EOT, read, sample_files, windows  # noqa: E402
from tools.quant_writers import QuantOptions, quantize_folder  # noqa: E402

DEMO = ROOT / "offload_engine" / "data" / "demo-model"
QUANTS = ("ct-int4", "ct-int8")
KERNELS = ("dequantize", "auto")


def quantized_copy(src: Path, quant: str, out: Path, opts: QuantOptions = QuantOptions()) -> Path:
    """A copy of `src` written in `quant` (kept in `out` and reused when already there)."""
    if (out / "config.json").exists() and "quantization_config" in (out / "config.json").read_text():
        return out
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    quantize_folder(out, quant, opts)
    return out


def held_out_perplexity(model: Path, kernels: str, files: int, windows_per_file: int = 2) -> dict:
    from tokenizers import Tokenizer as HFTokenizer

    from tools.train_demo import stdlib_files

    tok = HFTokenizer.from_file(str(model / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    nll, tokens = 0.0, 0
    with Engine.open(model, dtype="float32", kernels=kernels) as engine:
        for f in sample_files(stdlib_files()[1], files):
            ids = tok.encode(read(f)).ids + [eot]
            for w in windows(ids, windows_per_file):
                logits = engine.logits(w[:-1])
                nll += float(F.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum"))
                tokens += len(w) - 1
    return {"kernels": kernels, "tokens": tokens, "ppl": math.exp(nll / tokens)}


def decode_speed(model: Path, kernels: str, new_tokens: int, rounds: int, dtype: str = "float32") -> dict:
    prompt = list(range(5, 37))
    best = 0.0
    with Engine.open(model, dtype=dtype, kernels=kernels, max_context=len(prompt) + new_tokens) as engine:
        engine.generate(prompt, max_new_tokens=4, ignore_eos=True)  # warm-up (repacks happen at first use)
        for _ in range(rounds):
            stats = engine.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True).stats
            best = max(best, stats["decode_tok_s"])
        repacked = sum(a.items.get("repacked weights", 0) for a in engine.store.ledger.accounts.values())
    return {"kernels": kernels, "dtype": dtype, "decode_tok_s": best, "repacked_bytes": repacked}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "quant-kernels", help="quantized copies")
    ap.add_argument("--files", type=int, default=20, help="held-out files (eval_demo's sample)")
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--preset", default="bench", help="tools/make_checkpoint.py preset of the decode checkpoint")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes of the decode table")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    if not args.skip_ppl:
        rows = []
        for quant in QUANTS:
            model = quantized_copy(DEMO, quant, args.work / f"demo-{quant}", QuantOptions(strategy="channel"))
            got = {k: held_out_perplexity(model, k, args.files) for k in KERNELS}
            rel = got["auto"]["ppl"] / got["dequantize"]["ppl"] - 1
            rows.append({"quant": quant, **{f"ppl_{k}": got[k]["ppl"] for k in KERNELS},
                         "tokens": got["auto"]["tokens"], "relative": rel})
            print(f"perplexity {quant}: dequantize {got['dequantize']['ppl']:.4f}  fast {got['auto']['ppl']:.4f}  "
                  f"({rel * 100:+.3f}%, {got['auto']['tokens']} tokens)", flush=True)
        result["perplexity"] = rows
    if not args.skip_decode:
        from tools.make_checkpoint import make_checkpoint

        plain = args.work / f"{args.arch}-{args.preset}"
        if not (plain / "config.json").exists():
            make_checkpoint(args.arch, args.preset, plain, force=True)
        rows = []
        for quant in QUANTS:
            model = quantized_copy(plain, quant, args.work / f"{args.arch}-{args.preset}-{quant}")
            for dtype in args.dtypes.split(","):
                for kernels in KERNELS:
                    row = {"quant": quant, **decode_speed(model, kernels, args.tokens, args.rounds, dtype)}
                    rows.append(row)
                    print(f"decode {quant} {dtype:>8} {kernels:>10}: {row['decode_tok_s']:.2f} tok/s "
                          f"(repacked {row['repacked_bytes'] / 2**20:.1f} MiB)", flush=True)
        result["decode"] = {"checkpoint": f"{args.arch}/{args.preset}", "tokens": args.tokens,
                            "rounds": args.rounds, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
