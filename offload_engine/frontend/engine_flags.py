"""The budget and engine flags `run` and `serve` share, and the EngineConfig they build (validated as it is
built: config.py; what needs the machine, the device's presence, when the engine is assembled, and before
anything loads here: check_engine_flags, check_context; started_as_rank: whether this process is one of torchrun's
ranks)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..config import DTYPE_NAMES, Budget, EngineConfig, PrefetchConfig, SpeculativeConfig, check_threads
from ..constants import DEFAULT_CONTEXT, PREFILL_CHUNK
from ..errors import ConfigError, OffloadEngineError
from ..modes import DIRECT_IO_MODES, HOST_COMPUTE_MODES, KERNEL_MODES, KV_DTYPES, POLICIES, SPEC_MODES
from .common import progress


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The common ones first, the expert ones under headings (argparse prints groups in the order they are made,
    after the parser's own)."""
    p: Any = parser
    p.add_argument("--ram", metavar="SIZE", help="host RAM budget: 48GiB, 512MiB, 1.5GB or 25%% of the model "
                                                 "(across ranks: of each rank's layers; A,B,..: one per rank)")
    p.add_argument("--vram", metavar="SIZE", help="device memory budget, same forms as --ram")
    p.add_argument("--context", type=int, metavar="N",
                   help=f"KV cache positions reserved in the budget (default {DEFAULT_CONTEXT}, at most the model's "
                        "max_position_embeddings)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", choices=list(DTYPE_NAMES), help="compute dtype (default: bfloat16 on CUDA, and on a "
                   "CPU for a bfloat16 checkpoint where the CPU has native bf16; else float32)")
    p.add_argument("--spec", default="off", choices=SPEC_MODES,
                   help="speculative decoding: off (default); auto (cost model picks each step); ngram (prompt "
                        "lookup); mtp (the checkpoint's MTP layers); draft (--draft-model); self (the model "
                        "restricted to its resident experts)")
    spec = parser.add_argument_group("speculative decoding (expert)")
    spec.add_argument("--spec-depth", type=int, metavar="N", help="draft tokens per step (default: chosen each step)")
    spec.add_argument("--spec-width", type=int, metavar="N",
                      help="draft candidates per depth, a tree (default: chosen each step)")
    spec.add_argument("--draft-model", metavar="DIR",
                      help="a smaller checkpoint with the same tokenizer, for --spec draft|auto")
    spec.add_argument("--draft-ram", metavar="SIZE", help="host RAM budget of the draft model, same forms as --ram")
    spec.add_argument("--draft-vram", metavar="SIZE",
                      help="device memory budget of the draft model, same forms as --ram")
    p = parser.add_argument_group("memory, I/O and kernels (expert)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                   help=f"prompt tokens per forward (default {PREFILL_CHUNK}): larger reads each expert a long "
                        "prompt misses fewer times and needs more activation memory (plan --prefill-chunk)")
    p.add_argument("--policy", default="lru-floor", choices=POLICIES,
                   help="expert cache eviction policy (docs/PERF.md compares them)")
    p.add_argument("--direct-io", default="auto", choices=DIRECT_IO_MODES,
                   help="O_DIRECT reads (bypass the page cache); auto: on when the weights exceed --ram")
    p.add_argument("--host-compute", default="off", choices=HOST_COMPUTE_MODES,
                   help="compute experts held in RAM (not in VRAM) on the CPU instead of copying them; auto: where "
                        "measured rates say it is faster; on a GPU not bit-identical to device compute")
    p.add_argument("--kernels", default="auto", choices=KERNEL_MODES,
                   help="quantized weights: auto (fast kernels where they apply, docs/FORMATS.md) or dequantize "
                        "(always dequantize then multiply)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="KV cache storage: auto (the compute dtype), bf16, or fp8 / int8 (about half of bf16's bytes "
                        "per position, a quarter of fp32's; README: --kv-dtype)")
    p.add_argument("--threads", default="auto", metavar="N|auto",
                   help="torch intra-op threads; auto (default): at most torch's default, one core fewer while "
                        "weights stream, as many as other processes leave idle, re-measured while decoding "
                        "(--stats shows the count that ran)")
    p.add_argument("--stall-timeout", type=float, metavar="SECONDS",
                   help="fail a request when no checkpoint read makes progress for this long (default 60)")
    p = parser.add_argument_group("expert prefetch (expert)")
    p.add_argument("--prefetch", default="adaptive", choices=["adaptive", "on", "off"],
                   help="speculative expert prefetch; adaptive (default): only while it measurably pays")
    p.add_argument("--prefetch-depth", type=int, default=1, metavar="N", help="MoE layers predicted ahead")
    p.add_argument("--prefetch-reads", type=int, default=1, metavar="N",
                   help="lookahead guesses read per token at each layer, in forwards that do not route ahead "
                        "(default 1; more pays only with spare disk bandwidth)")
    p.add_argument("--route-ahead", type=int, default=2, metavar="N",
                   help="MoE layers whose routing a layer waiting for expert reads predicts, to read their experts "
                        "early (default 2; 0: off; part of expert prefetching, which --prefetch adaptive "
                        "keeps only while it pays)")
    p.add_argument("--trace", metavar="FILE",
                   help="routing counts of earlier runs (tools/trace_experts.py) seeding the prefetch's prior")


def prefetch_config(args: argparse.Namespace) -> PrefetchConfig | bool:
    """--prefetch, --prefetch-depth, --prefetch-reads, --route-ahead and --trace as EngineConfig's `prefetch` (a
    PrefetchConfig, or False). Their limits are PrefetchConfig's (its errors name the flags), checked with
    --prefetch off too."""
    if args.trace is not None and not Path(args.trace).is_file():
        raise ConfigError(f"--trace {args.trace}: no such file (write one with tools/trace_experts.py record)")
    config = PrefetchConfig(depth=args.prefetch_depth, reads=args.prefetch_reads, route_ahead=args.route_ahead,
                            adaptive=args.prefetch == "adaptive")
    return args.prefetch != "off" and config


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of `run`'s (or `serve`'s) flags, validated as it is built; --device checked against this
    machine too (a CUDA device where there is none), as before anything loads."""
    prefetch = prefetch_config(args)
    speculative = SpeculativeConfig(mode=args.spec, depth=args.spec_depth, width=args.spec_width,
                                    draft_model=args.draft_model,
                                    draft_budget=Budget(vram=args.draft_vram, ram=args.draft_ram))
    config = EngineConfig(budget=Budget(vram=args.vram, ram=args.ram), device=args.device, dtype=args.dtype,
                          max_context=args.context, policy=args.policy, direct_io=args.direct_io,
                          prefetch=prefetch, trace=args.trace, allow_cast=args.allow_cast,
                          progress=progress(args), stall_timeout=args.stall_timeout, speculative=speculative,
                          host_compute=args.host_compute, prefill_chunk=args.prefill_chunk, kernels=args.kernels,
                          kv_dtype=args.kv_dtype, threads=args.threads,
                          cache_ram=getattr(args, "cache_ram", 0))  # serve --cache-ram
    from ..runtime.devices import resolve_device  # imports torch

    resolve_device(config.device)
    return config


def check_engine_flags(args: argparse.Namespace) -> None:
    """--threads, checked before anything loads; Engine.open applies it (EngineConfig.threads, runtime/threads.py)."""
    check_threads(args.threads)


def started_as_rank() -> bool:
    import os

    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_context(model: str | Path, context: int | None) -> None:
    """--context beyond the positions the model supports (max_position_embeddings, or more where its rope scaling
    stretches it) is refused before anything loads. A model whose config cannot be read here is left to
    Engine.open, which reports it. (`run` and `serve` check it.)"""
    if context is None:
        return
    if context < 1:
        raise ConfigError(f"--context must be >= 1, got {context}")
    from ..planner.kv import context_limit
    from ..planner.plan import gguf_model_spec, load_model_spec

    path = Path(model).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            spec = gguf_model_spec(path)
        elif (path / "config.json").is_file():
            spec = load_model_spec(str(path))
        else:
            return
    except OffloadEngineError:
        return
    limit = context_limit(spec)
    if context > limit:
        scaled = " (with its rope scaling)" if limit > spec.max_position_embeddings else ""
        raise ConfigError(f"--context {context}: {path} supports at most {limit} positions{scaled} "
                          f"(max_position_embeddings {spec.max_position_embeddings}); give --context {limit} or less")
