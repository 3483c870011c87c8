#!/usr/bin/env python3
"""The bundled demo model quantized by `offload-engine quantize`, against its bf16 copy: held-out perplexity
(tools/eval_demo.py's files and 128-token windows) and MTP drafting acceptance (eval_demo's code prompts, greedy,
chains of depth 1 and 2). tests/test_quantize.py checks int8 within 1% and int4 within 5% of bf16, and int4's
MTP acceptance within 10% of bf16's, with these functions.

    python tools/quantize_eval.py --work build/quantize-eval          # about 3 min on 2 cores
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
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    base = bf16_copy(args.work / "bf16")
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
