"""tools/bench.py's llama.cpp peer: the same checkpoint, resident, decoded by the engine and by llama.cpp's
llama-bench on the same threads, at the same bit width, in the same bench run.

Pairs (engine format: GGUF type): bf16: BF16 (the GGUF converted from the bf16 checkpoint by llama.cpp's own
convert_hf_to_gguf.py), ct-int8: Q8_0 and ct-int4: Q4_K_M (both made from that BF16 GGUF by llama-quantize; the
engine's come from tools/make_checkpoint.py --quant, tools/bench_formats.build). The engine runs each with every
unit resident and compute dtype bfloat16 (tools/bench.run_engine: an untimed warm-up request, then the measured
one, `rounds` times, the median shown); llama-bench runs tgN (N = the bench's --tokens, no prompt) with as many
threads as torch uses, 3 repetitions. A last row runs the bf16 checkpoint with Engine.open's default dtype (how
a new user runs it). Each side is also set against the physical bound of its own file: active bytes per token /
the bench's measured memory read bandwidth (tools/bench_physical.py). Everything is resident, so routing does not
matter: the pairs use the random-routing checkpoints also with --routing realistic.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tools import llama_peer
from tools.bench_physical import active_bytes_gguf, active_bytes_hf

PAIRS = (("bf16", "BF16"), ("ct-int8", "Q8_0"), ("ct-int4", "Q4_K_M"))


@dataclass
class LlamaSettings:
    arch: str
    preset: str
    cache: Path  # engine checkpoints (bench_formats' layout) and GGUFs
    model: Path | None  # --model: only its bf16 pair is run (no quantized engine checkpoints are written from it)
    tokens: int
    rounds: int
    threads: int
    progress: bool

    @classmethod
    def of(cls, args) -> "LlamaSettings":
        return cls("qwen3_moe", "offload" if args.quick else "bench", Path(args.work_dir) / "formats",
                   Path(args.model) if args.model else None, args.tokens, min(args.rounds, 3),
                   torch.get_num_threads(), args.progress)


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(f"llama peer: {msg}", file=sys.stderr, flush=True)


def prepare(s: LlamaSettings) -> list[tuple[str, str, Path, Path]]:
    """(engine format, GGUF type, engine checkpoint, GGUF) per pair, building what is missing."""
    from tools.bench_formats import build

    if s.model is not None:
        engine = {"bf16": s.model}
        stem = s.cache / "gguf" / s.model.name
    else:
        engine = {fmt: build(fmt, s.arch, s.preset, s.cache) for fmt, _ in PAIRS}
        stem = s.cache / "gguf" / f"{s.arch}-{s.preset}"
    _say(f"converting {engine['bf16']} with llama.cpp's convert_hf_to_gguf.py", s.progress)
    base = llama_peer.convert(engine["bf16"], f"{stem}-BF16.gguf", "bf16")
    ggufs = {"BF16": base}
    for fmt, qtype in PAIRS[1:]:
        if fmt in engine:
            ggufs[qtype] = llama_peer.quantize(base, qtype, threads=s.threads)
    return [(fmt, q, engine[fmt], ggufs[q]) for fmt, q in PAIRS if fmt in engine]


def run_llama_section(s: LlamaSettings, prompt: list[int], warm: list[int], mem_bw: float,
                      run_engine: Callable[..., Any]) -> dict[str, Any]:
    """Every pair: the engine's resident runs and llama-bench, interleaved pair by pair."""
    llama_peer.ensure_built(progress=s.progress)
    rows = []
    pairs = prepare(s)
    top_k, experts = _routing_shape(pairs[0][2])
    for fmt, qtype, model, gguf in pairs:
        _say(f"engine {fmt} vs llama.cpp {qtype}, {s.threads} threads", s.progress)
        runs = [run_engine(model, None, prompt, warm, s.tokens, False, dtype="bfloat16") for _ in range(s.rounds)]
        engine = sorted(runs, key=lambda r: r.s_per_token)[(len(runs) - 1) // 2]
        bench = llama_peer.run_bench(gguf, s.threads, n_gen=s.tokens)
        rows.append(_row(fmt, qtype, model, gguf, runs, engine, bench, mem_bw, top_k, experts))
    default = [run_engine(pairs[0][2], None, prompt, warm, s.tokens, False) for _ in range(s.rounds)]
    d = sorted(default, key=lambda r: r.s_per_token)[(len(default) - 1) // 2]
    first = rows[0]
    return {"threads": s.threads, "tokens": s.tokens, "rounds": s.rounds, "memory_read_bytes_per_s": mem_bw,
            "llama_cpp": {"sdist": f"llama-cpp-python=={llama_peer.SDIST_VERSION}",
                          "build_commit": rows[0]["llama"]["build_commit"], "bin": str(llama_peer.bin_dir())},
            "pairs": rows,
            "engine_default_dtype": {"format": "bf16", "tok_s": d.tok_s, "all_tok_s": [r.tok_s for r in default],
                                     "vs_llama_bf16": d.tok_s / first["llama"]["tok_s"],
                                     "tokens": d.tokens}}


def _routing_shape(model: Path) -> tuple[int, int]:
    import json

    config = json.loads((model / "config.json").read_text())
    config = {**config, **config.get("text_config", {})}
    experts = config.get("num_experts") or config.get("num_local_experts")  # transformers 5 saves the latter
    return int(config.get("num_experts_per_tok") or 0), int(experts or 1)


def _row(fmt: str, qtype: str, model: Path, gguf: Path, runs: list, engine, bench, mem_bw: float, top_k: int,
         experts: int) -> dict[str, Any]:
    e_active, l_active = active_bytes_hf(model), active_bytes_gguf(gguf, top_k, experts)
    e_bound, l_bound = e_active.per_token / mem_bw, l_active.per_token / mem_bw
    return {"engine_format": fmt, "gguf_type": qtype, "engine_model": str(model), "gguf": str(gguf),
            "engine_tok_s": engine.tok_s, "engine_all_tok_s": [r.tok_s for r in runs],
            "engine_tok_s_spread": [min(r.tok_s for r in runs), max(r.tok_s for r in runs)],
            "llama": asdict(bench), "llama_tok_s": bench.tok_s,
            "engine_vs_llama": engine.tok_s / bench.tok_s,
            "engine_active_bytes": e_active.per_token, "gguf_active_bytes": l_active.per_token,
            "engine_bound_s_per_token": e_bound, "gguf_bound_s_per_token": l_bound,
            "engine_vs_physical": engine.s_per_token / e_bound, "llama_vs_physical": (1 / bench.tok_s) / l_bound,
            "engine_tokens": engine.tokens, "engine_hit_rate": engine.hit_rate}


def llama_table(section: dict[str, Any]) -> str:
    lines = [f"llama.cpp peer (resident, {section['threads']} threads, tg{section['tokens']}; llama.cpp "
             f"{section['llama_cpp']['build_commit']} from {section['llama_cpp']['sdist']})",
             f"{'engine':>8} {'tok/s':>7} {'llama':>7} {'tok/s':>7} {'engine':>6} {'active':>7} {'active':>7} "
             f"{'engine':>6} {'llama':>6}",
             f"{'format':>8} {'':>7} {'type':>7} {'':>7} {'/llama':>6} {'MB eng':>7} {'MB gguf':>7} "
             f"{'/phys':>6} {'/phys':>6}"]
    for r in section["pairs"]:
        lines.append(f"{r['engine_format']:>8} {r['engine_tok_s']:>7.2f} {r['gguf_type']:>7} {r['llama_tok_s']:>7.2f} "
                     f"{r['engine_vs_llama']:>6.2f} {r['engine_active_bytes'] / 1e6:>7.1f} "
                     f"{r['gguf_active_bytes'] / 1e6:>7.1f} {r['engine_vs_physical']:>6.2f} "
                     f"{r['llama_vs_physical']:>6.2f}")
    d = section["engine_default_dtype"]
    lines.append(f"engine bf16 checkpoint with Engine.open's default dtype: {d['tok_s']:.2f} tok/s, "
                 f"{d['vs_llama_bf16']:.2f}x llama.cpp BF16 (spread {min(d['all_tok_s']):.2f}-"
                 f"{max(d['all_tok_s']):.2f})")
    return "\n".join(lines)
