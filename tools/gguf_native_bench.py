#!/usr/bin/env python3
"""GGUF decode speed and per-matmul times: the native kernels reading the blocks in place (a bf16 compute, the
default for Q8_0 / Q4_0 / K-quant files) against float32 with dequantize / torch's int4 kernel (the previous
default), on one file (issue 50). Write a CI-size file of the real width first:

    python tools/synthetic_gguf.py --config configs/models/Qwen3-30B-A3B.json --type Q4_0 --layers 2 \\
        --routing random --out /work/big/q30b-2l-Q4_0.gguf
    python tools/gguf_native_bench.py /work/big/q30b-2l-Q4_0.gguf [--tokens 8] [--skip-float32]

Prints one JSON object: per path the decode tok/s, the stats' cpu_kernels and the anonymous memory after open;
per weight (an expert's gate and down, q_proj, the output head) the microseconds of one row through each path
(best of --repeats) and the native output's relative error against the float32 matmul of the dequantized weight
(float input, and the input rounded to bf16). Timings on a shared machine are noisy: compare within one run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_engine.runtime import gguf_dequant  # noqa: E402
from offload_engine.runtime.kernels import cpu_int, native_build  # noqa: E402


def anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return round(best * 1e6, 1)


def weights(path: Path) -> dict[str, tuple[str, torch.Tensor, int]]:
    """name -> (type, blocks uint8 [N, row bytes], K) of a few weights of the file."""
    import gguf

    reader = gguf.GGUFReader(path)
    t = {x.name: x for x in reader.tensors}
    out = {}
    for label, name, expert in (("expert_gate", "blk.0.ffn_gate_exps.weight", 0),
                                ("expert_down", "blk.0.ffn_down_exps.weight", 0),
                                ("q_proj", "blk.0.attn_q.weight", None), ("head", "output.weight", None)):
        x = t[name]
        data = np.asarray(x.data)
        if expert is not None:
            data = data[expert]
        k = int(x.shape[0])  # ggml order: the row's length first
        out[label] = (x.tensor_type.name, torch.from_numpy(np.ascontiguousarray(data)), k)
    return out


def matmuls(path: Path, repeats: int) -> dict:
    module = native_build.load()
    report = {}
    gen = torch.Generator().manual_seed(0)
    for label, (gtype, blocks, k) in weights(path).items():
        n = blocks.shape[0]
        x = torch.randn(1, k, generator=gen)
        xb = x.bfloat16()
        meta = torch.tensor([gguf_dequant.NATIVE_TYPES[gtype], k, 0], dtype=torch.int64)
        dense = gguf_dequant.dequantize(blocks, gtype, k)
        row = {"type": gtype, "shape": [n, k]}
        row["native_bf16_us"] = best_us(lambda: module.int_linear(xb, [blocks, meta]), repeats)
        row["dequantize_fp32_us"] = best_us(lambda: F.linear(x, gguf_dequant.dequantize(blocks, gtype, k)),
                                            max(2, repeats // 4))
        if gtype in gguf_dequant.INT4_TYPES:  # the float32 default's path for Q4_0: torch's int4 kernel
            from offload_engine.checkpoint.formats import QuantSpec

            q = QuantSpec(kind="gguf", bits=4, out=n, inp=k, gtype=gtype)
            packed, sz = cpu_int.repack_int4(q, {"data": blocks, "scale": None, "zero": None}, torch.float32)
            row["torch_int4_fp32_us"] = best_us(lambda: cpu_int.int4_mm(x, packed, sz), repeats)
        got = module.int_linear(xb, [blocks, meta]).double()
        exact = (x.double() @ dense.double().T)
        exact_b = (xb.double() @ dense.double().T)
        row["rel_err_vs_fp32_input"] = float((got - exact).norm() / exact.norm())
        row["rel_err_vs_bf16_input"] = float((got - exact_b).norm() / exact_b.norm())
        report[label] = row
    return report


def decode(path: Path, dtype: str | None, tokens: int) -> dict:
    from offload_engine import Engine

    before = anon_mib()
    with Engine.open(path, dtype=dtype, max_context=64) as engine:
        opened = anon_mib()
        ids = [5, 6, 7, 8]
        engine.generate(ids, max_new_tokens=2, ignore_eos=True)  # warm: first-touch, kernel choices
        result = engine.generate(ids, max_new_tokens=tokens, ignore_eos=True)
        stats = result.stats
        kernels = stats.get("cpu_kernels") or {}
        return {"dtype": stats.get("dtype"), "decode_tok_s": round(stats["decode_tok_s"], 3),
                "anon_mib_after_open": round(opened - before, 1), "native_gguf": kernels.get("native_gguf"),
                "native_experts": kernels.get("native_experts")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-float32", action="store_true", help="only the native (bf16) decode")
    args = ap.parse_args(argv)
    out = {"file": str(args.gguf), "threads": torch.get_num_threads(), "isa": native_build.isa(),
           "matmuls": matmuls(args.gguf, args.repeats), "decode": {"native_bf16": decode(args.gguf, None, args.tokens)}}
    if not args.skip_float32:
        out["decode"]["float32_dequantize"] = decode(args.gguf, "float32", args.tokens)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
