#!/usr/bin/env python3
"""The bundled demo model quantized by `offload-engine quantize`, against its bf16 copy: held-out perplexity
(tools/eval_demo.py's files and 128-token windows) and MTP drafting acceptance (eval_demo's code prompts, greedy,
chains of depth 1 and 2). tests/test_quantize.py checks int8 within 1% and int4 within 5% of bf16, and int4's
MTP acceptance within 10% of bf16's, with these functions.

    python tools/quantize_eval.py --work build/quantize-eval          # about 3 min on 2 cores
    python tools/quantize_eval.py --work build/gptq-eval --calibrated # RTN against --calibrate (GPTQ), perplexity

--calibrated: int4 (groups of 32 and 128) and int8 rounded to nearest and by `--calibrate` on `calibration_text`
(the held-out stdlib files the perplexity sample does not use: about 12k tokens), in windows of 128 tokens (the
demo's training length, as its perplexity windows), held-out perplexity only.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_engine import Engine  # noqa: E402
from offload_engine.defaults import PACKAGE_MODEL  # noqa: E402

SIDE = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def bf16_copy(out: Path, src: Path = PACKAGE_MODEL) -> Path:
    """The demo model as most checkpoints ship: bf16 weights (its own file is fp32)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    tensors = load_file(src / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    for f in SIDE:
        (out / f).write_bytes((src / f).read_bytes())
    return out


def held_out_ppl(model: Path, files: int = 20) -> float:
    from tokenizers import Tokenizer

    from tools.eval_demo import EOT, read, sample_files, windows
    from tools.train_demo import stdlib_files

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    nll, n = 0.0, 0
    with Engine.open(model, dtype="float32") as engine:
        for f in sample_files(stdlib_files()[1], files):
            for w in windows(tok.encode(read(f)).ids + [tok.token_to_id(EOT)]):
                nll += float(F.cross_entropy(engine.logits(w[:-1]), torch.tensor(w[1:]), reduction="sum"))
                n += len(w) - 1
    return math.exp(nll / n)


def calibration_text(out: Path) -> Path:
    """The held-out files tools/eval_demo.py's perplexity sample leaves out (disjoint from the files both
    training and evaluation read), joined into one text file."""
    from tools.eval_demo import read, sample_files
    from tools.train_demo import stdlib_files

    held_out = stdlib_files()[1]
    evaluated = set(sample_files(held_out))
    out.write_text("\n".join(read(f) for f in sorted(held_out) if f not in evaluated), encoding="utf-8")
    return out


def calibrated_rows(work: Path, base: Path, tokens: int) -> dict[str, float]:
    """Held-out perplexity of RTN and --calibrate for int4 g32, int4 g128 and int8 (per channel)."""
    from offload_engine.cli import main as cli
    from tools.eval_demo import WINDOW  # the demo's training length (longer calibration windows fit it worse)

    text = calibration_text(work / "calibration.txt")
    rows = {"bf16": held_out_ppl(base)}
    print(f"{'bf16':>16}: perplexity {rows['bf16']:.3f}", flush=True)
    for weights, group in (("int4", "32"), ("int4", "128"), ("int8", "0")):
        gptq = ["--calibrate", str(text), "--calibration-tokens", str(tokens), "--calibration-window", str(WINDOW)]
        for method, flags in (("rtn", []), ("gptq", gptq)):
            name = f"{weights}-g{group}-{method}"
            if cli(["quantize", "--model", str(base), "--out", str(work / name), "--weights", weights, "--group",
                    group, "--quiet", *flags]):
                raise SystemExit(f"quantize {name} failed")
            rows[name] = held_out_ppl(work / name)
            print(f"{name:>16}: perplexity {rows[name]:.3f} ({100 * (rows[name] / rows['bf16'] - 1):+.2f}%)",
                  flush=True)
    return rows


def mtp_acceptance(model: Path, prompts: int = 6, depths: tuple[int, ...] = (1,)) -> dict[int, list[float]]:
    """Acceptance per draft position at each depth; every output equal to plain decoding (checked)."""
    from tools.eval_demo import code_prompts, mtp_acceptance as measure, sample_files
    from tools.train_demo import stdlib_files

    with Engine.open(model, dtype="float32", max_context=1024, spec="mtp") as engine:
        ids = [engine.encode(p["prompt"]) for p in code_prompts(sample_files(stdlib_files()[1]), prompts)]
        result, _ = measure(engine, ids, depths)
    out = {}
    for d in depths:
        r = result["depths"][str(d)]
        if not r["identical_to_plain"]:
            raise AssertionError(f"{model}: MTP depth {d} changed the greedy output")
        out[d] = r["acceptance_per_depth"]
    return out


def main(argv=None) -> int:
    from offload_engine.cli import main as cli

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="a folder to create")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--calibrated", action="store_true", help="RTN against --calibrate (perplexity only)")
    ap.add_argument("--calibration-tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    base = bf16_copy(args.work / "bf16")
    if args.calibrated:
        rows = calibrated_rows(args.work, base, args.calibration_tokens)
        (args.work / "calibrated.json").write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    models = {"bf16": base}
    for w in ("int8", "int4", "fp8"):
        models[w] = args.work / w
        if cli(["quantize", "--model", str(base), "--out", str(models[w]), "--weights", w, "--quiet"]):
            return 1
    rows = {}
    for name, path in models.items():
        rows[name] = {"ppl": held_out_ppl(path), "mtp": mtp_acceptance(path, args.prompts, (1, 2))}
        r = rows[name]
        print(f"{name:>5}: perplexity {r['ppl']:.3f} ({100 * (r['ppl'] / rows['bf16']['ppl'] - 1):+.2f}%), MTP "
              f"acceptance depth 1 {r['mtp'][1][0]:.3f}, depth 2 {', '.join(f'{a:.3f}' for a in r['mtp'][2])}",
              flush=True)
    (args.work / "figures.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
