"""offload-engine: run | serve | inspect | plan | probe | quantize. Each subcommand parses, calls the API or planner, and prints.

Exit codes: 0 ok, 2 bad input (flags, checkpoint), 3 resources (budget, I/O), 130 interrupted.
Errors print one line without a traceback unless --debug.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

# only small modules here (no torch, no argparse or socket): the console script imports this module before
# main() takes Ctrl-C over, and until then an interrupt prints a traceback, or is lost (SIGINT ignored)
from .errors import OffloadEngineError
from .interrupts import SafeInterrupts, exit_at_once_on_sigint
from .constants import DEFAULT_CONTEXT, PREFILL_CHUNK
from .modes import DIRECT_IO_MODES, HOST_COMPUTE_MODES, KERNEL_MODES, KV_DTYPES, SPEC_MODES
from .store.policy import POLICIES
from .units import format_bytes

if TYPE_CHECKING:
    import argparse
    from typing import Any, Sequence

def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    """The budget and engine flags `run` and `serve` share (engine_config reads them): the common ones first, the
    expert ones under headings (argparse prints groups in the order they are made, after the parser's own)."""
    from .config import DTYPES  # imports torch

    p: Any = parser
    p.add_argument("--ram", metavar="SIZE", help="host RAM budget: 48GiB, 512MiB, 1.5GB or 25%% of the model "
                                                 "(across ranks: of each rank's layers; A,B,..: one per rank)")
    p.add_argument("--vram", metavar="SIZE", help="device memory budget, same forms as --ram")
    p.add_argument("--context", type=int, metavar="N",
                   help=f"KV cache positions reserved in the budget (default {DEFAULT_CONTEXT}, at most the model's "
                        "max_position_embeddings)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", choices=list(DTYPES), help="compute dtype (default: bfloat16 on CUDA, and on a CPU for a "
                   "bfloat16 checkpoint where the CPU has native bf16; else float32)")
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


def build_parser() -> argparse.ArgumentParser:
    import argparse

    from .cli_front import INSPECT_EXAMPLES, RUN_EXAMPLES, FrontParser, add_model_arguments, version
    from .planner.commands import add_plan_parser, add_probe_parser  # these import torch
    from .quantize.command import add_quantize_parser
    from .server.command import SERVE_EXAMPLES, add_serve_flags

    parser = FrontParser(prog="offload-engine", description="Run MoE and dense LLMs far larger than device memory.")
    parser.add_argument("--version", action="version", version=f"offload-engine {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text", epilog=RUN_EXAMPLES,
                         usage="offload-engine run [MODEL | --model DIR] --prompt TEXT [options]",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(run, "Hugging Face folder (config.json + *.safetensors) or a .gguf file")
    run.add_argument("--prompt", required=True, metavar="TEXT", help="prompt text; - reads it from stdin")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate at most "
                                                                               "(default 64)")
    run.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off (default)")
    run.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1 = off (default)")
    run.add_argument("--min-p", type=float, default=0.0, metavar="P", help="0 = off (default)")
    run.add_argument("--seed", type=int, default=None, metavar="N", help="sampling seed (default: random)")
    run.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    run.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    run.add_argument("--stats", action="store_true", help="print a one-line summary after generation")
    _common(run)
    _engine_flags(run)
    out = run.add_argument_group("structured output")
    out.add_argument("--grammar", metavar="FILE", help="a Lark grammar file the output must match")
    out.add_argument("--json-schema", metavar="FILE|JSON", help="a JSON schema (a file, or inline JSON) the output "
                                                               "must match (compact JSON)")
    ranks = run.add_argument_group("several devices (docs/SCALE.md)")
    ranks.add_argument("--devices", metavar="A,B,...",
                       help="split the layers over one rank per device (cpu,cpu or cuda:0,cuda:1), started here; "
                            "under torchrun each rank takes its own")
    ranks.add_argument("--split", metavar="A:B,C:D,..",
                       help="the layers of each pipeline stage (stage 0 on rank 1, the last on rank 0), e.g. what "
                            "`plan --ranks` prints; default: alike ranks, balanced by bytes read per token")
    check = run.add_argument_group("diagnostics")
    check.add_argument("--show-plan", action="store_true", help="print the placement before generating")
    check.add_argument("--allow-cast", action="store_true", help="accept tensors whose dtype differs from config.json")
    run.set_defaults(func=cmd_run)

    ins = sub.add_parser("inspect", help="describe a checkpoint without loading it", epilog=INSPECT_EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ins, "Hugging Face folder or a .gguf file")
    ins.add_argument("--json", action="store_true")
    _common(ins)
    ins.set_defaults(func=cmd_inspect)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server and a chat page",
                           usage="offload-engine serve [MODEL | --model DIR] [options]",
                           epilog=SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(serve, "Hugging Face folder or a .gguf file")
    _engine_flags(serve)
    add_serve_flags(serve)
    serve.add_argument("--show-plan", action="store_true", help="print the placement before serving")
    serve.add_argument("--allow-cast", action="store_true", help="accept tensors whose dtype differs from config.json")
    _common(serve)
    serve.set_defaults(func=cmd_serve, json=False)
    add_plan_parser(sub)
    add_probe_parser(sub)
    add_quantize_parser(sub)
    return parser


def _bars(args: argparse.Namespace) -> bool:
    """Progress bars at all: a terminal on stderr and no --quiet."""
    return not args.quiet and sys.stderr.isatty()


def _progress(args: argparse.Namespace) -> bool:
    """The loading bar: also off with --json (machine-read output)."""
    return _bars(args) and not getattr(args, "json", False)


def _prefetch_config(args: argparse.Namespace) -> Any:
    """--prefetch, --prefetch-depth, --prefetch-reads, --route-ahead and --trace as EngineConfig's `prefetch` (a
    PrefetchConfig, or False)."""
    from pathlib import Path

    from .errors import ConfigError
    from .prefetch.prefetcher import PrefetchConfig

    for flag, value, least in (("--prefetch-depth", args.prefetch_depth, 1),
                               ("--prefetch-reads", args.prefetch_reads, 1), ("--route-ahead", args.route_ahead, 0)):
        if value < least:
            raise ConfigError(f"{flag} must be an integer >= {least}, got {value}")
    if args.trace is not None and not Path(args.trace).is_file():
        raise ConfigError(f"--trace {args.trace}: no such file (write one with tools/trace_experts.py record)")
    return args.prefetch != "off" and PrefetchConfig(depth=args.prefetch_depth, reads=args.prefetch_reads,
                                                     route_ahead=args.route_ahead,
                                                     adaptive=args.prefetch == "adaptive")


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig of `run`'s flags (validated as it is built)."""
    from .config import Budget, EngineConfig, SpeculativeConfig

    prefetch = _prefetch_config(args)
    speculative = SpeculativeConfig(mode=args.spec, depth=args.spec_depth, width=args.spec_width,
                                    draft_model=args.draft_model,
                                    draft_budget=Budget(vram=args.draft_vram, ram=args.draft_ram))
    return EngineConfig(budget=Budget(vram=args.vram, ram=args.ram), device=args.device, dtype=args.dtype,
                        max_context=args.context, policy=args.policy, direct_io=args.direct_io,
                        prefetch=prefetch, trace=args.trace, allow_cast=args.allow_cast,
                        progress=_progress(args), stall_timeout=args.stall_timeout, speculative=speculative,
                        host_compute=args.host_compute, prefill_chunk=args.prefill_chunk, kernels=args.kernels,
                        kv_dtype=args.kv_dtype, threads=args.threads,
                        cache_ram=getattr(args, "cache_ram", 0))  # serve --cache-ram


def _check_threads(threads: str) -> None:
    """--threads, checked before anything loads; Engine.open applies it (EngineConfig.threads, runtime/threads.py)."""
    from .runtime.threads import check_threads

    check_threads(threads)


def cmd_run(args: argparse.Namespace) -> int:
    from .api import Engine
    from .cli_front import check_context, read_prompt
    from .defaults import default_model_path

    _check_threads(args.threads)
    model = args.model or default_model_path()
    read_prompt(args)
    check_context(model, args.context)
    ranked = args.devices or _started_as_rank()  # pipeline ranks: rank 0 generates and prints, the others serve it
    if ranked:
        from .distributed.command import run_ranked, this_ranks_share

        args.ram, args.vram = this_ranks_share(args.ram, "--ram"), this_ranks_share(args.vram, "--vram")
        if args.devices and not _started_as_rank():
            args.ram = args.vram = None  # the launcher itself loads nothing: its ranks take their shares
    config = engine_config(args)
    if ranked:
        return run_ranked(model, config, args.devices, args.argv, lambda engine: _generate(engine, args),
                          split=args.split)
    # not `with Engine.open(...)`: a Ctrl-C landing in __enter__ would skip __exit__; nothing can interrupt
    # between this assignment and the `try`
    engine = Engine.open(model, config)
    try:
        return _generate(engine, args)
    finally:
        engine.close()


def _started_as_rank() -> bool:
    import os

    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_serve(args: argparse.Namespace) -> int:
    from .api import Engine
    from .cli_front import check_context
    from .defaults import default_model_path
    from .server.command import check_serve_flags, serve

    _check_threads(args.threads)
    if _started_as_rank():
        from .errors import ConfigError

        raise ConfigError("serve runs in one process: the layers split across ranks (torchrun, --devices) is "
                          "available to `run` only")
    check_serve_flags(args)  # before loading: a refused bind costs no load
    check_context(args.model or default_model_path(), args.context)
    engine = Engine.open(args.model or default_model_path(), engine_config(args))
    try:
        if args.show_plan:
            print(engine.placement.describe(), file=sys.stderr)
        return serve(engine, args)
    finally:
        engine.close()


def _generate(engine: Any, args: argparse.Namespace) -> int:
    import json

    from .cli_front import grammar_of
    from .generate.decoder import FinishEvent

    if args.show_plan:
        print(engine.placement.describe(), file=sys.stderr)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
                    grammar=grammar_of(args))
    finish = None
    # --json holds the text back until the end: a progress bar on stderr (terminals only) shows it is working
    bar = _token_bar(args.max_new_tokens) if args.json and _bars(args) else None
    for event in engine.stream(args.prompt, chat=args.chat, **sampling):
        if isinstance(event, FinishEvent):
            finish = event
        elif bar is not None:
            bar.update(1)
        elif not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    if bar is not None:
        bar.close()
    assert finish is not None
    stats = finish.stats
    if args.json:
        print(json.dumps({"text": finish.text, "token_ids": finish.token_ids, "finish_reason": finish.reason,
                          "stats": stats}))
    else:
        sys.stdout.write("\n")
        if args.stats:
            print(format_stats(stats), file=sys.stderr)
    return 0


def _token_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="tok", file=sys.stderr, leave=False)


def format_stats(stats: dict[str, Any]) -> str:
    hit_rate = 100 * stats["hit_rate"]
    kv = f", KV {stats['kv_dtype']}" if stats.get("kv_dtype", "auto") != "auto" else ""
    peak = stats["peak_bytes"]
    drafted = ""
    if stats.get("spec", "off") != "off":
        drafted = (f" | spec {stats['spec']}: {stats['tokens_per_forward']:.2f} tokens/forward, "
                   f"{stats['mean_accepted']:.2f} accepted/draft over {stats['spec_steps']} drafts")
    return (f"[{stats['generated_tokens']} tokens | prefill {stats['prefill_tok_s']:.1f} tok/s | "
            f"decode {stats['decode_tok_s']:.2f} tok/s{drafted} | hit rate {hit_rate:.1f}% | "
            f"disk {format_bytes(stats['bytes_read_disk_per_token'])}/token | io wait {stats['io_wait_s']:.2f} s | "
            f"peak device {format_bytes(peak['device'] or 0)}, host {format_bytes(peak['host'] or 0)} | "
            f"{stats['device']} {stats['dtype']}{kv}{_native(stats.get('cpu_kernels'))}{_threads(stats)}]")


def _threads(stats: dict[str, Any]) -> str:
    """', 2 threads (auto, of 2)': the intra-op count the decode ran at (api._thread_stats)."""
    if stats.get("threads") is None:
        return ""
    n, choice = stats["threads"], stats.get("thread_choice") or {}
    rule = f" ({choice['setting']}, of {choice['max']})" if choice.get("setting") == "auto" else ""
    return f", {n} thread{'s' if n != 1 else ''}{rule}"


def _native(kernels: dict | None) -> str:
    """', native kernels: N shapes + experts' where the CPU decode takes the engine's own kernels."""
    if not kernels or not (kernels["native_linear"] or kernels["native_experts"]):
        return ""
    experts = " + experts" if kernels["native_experts"] else ""
    return f", native kernels: {len(kernels['native_linear'])} shapes{experts}"


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from .checkpoint.model import open_model
    from .planner.inspect_report import inspect_report, inspect_text
    from .runtime.mtp import attach_mtp_units

    ck = attach_mtp_units(open_model(args.model))  # MTP layers counted as such, not listed as unused tensors
    report = inspect_report(ck)
    print(json.dumps(report, indent=2) if args.json else inspect_text(report))
    return 0


# what each command imports before it makes anything: imported while a Ctrl-C still ends the process at once
# (main). Only start-up time: under SafeInterrupts an import is never interrupted, its interrupt lands after it.
COMMAND_IMPORTS = {"run": ("offload_engine.api",),
                   "serve": ("offload_engine.api", "offload_engine.server.app", "uvicorn"),
                   "inspect": ("offload_engine.checkpoint.model", "offload_engine.planner.inspect_report",
                               "offload_engine.runtime.mtp"),
                   "plan": ("offload_engine.probe",), "probe": ("offload_engine.probe",),
                   "quantize": ("offload_engine.quantize.convert", "offload_engine.quantize.calibrated",
                                "offload_engine.quantize.calibration", "tqdm")}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the exit status. Run as the program (argv None: the console script,
    `python -m offload_engine.cli`), Ctrl-C ends the process with status 130, without a traceback: at once
    while it starts (imports, flags: nothing made yet, and an interrupt raised inside torch's import can be
    swallowed by its C++ init), else right after the command has closed what it made (reader threads joined,
    descriptors closed, partial output removed): the interpreter's own teardown of torch can take seconds."""
    import gc
    from importlib import import_module

    program = argv is None
    if program:  # before anything else: SIGINT may even be ignored so far (a background job of a script)
        exit_at_once_on_sigint()
        gc.disable()  # a full collection amid torch's import holds the GIL (no handler runs) for 0.1-1 s
    guard = args = None
    try:
        try:
            if not program:  # called in-process: the caller's imports are done, and it must get 130 back
                guard = SafeInterrupts()
            args = build_parser().parse_args(argv)
            args.argv = list(sys.argv[1:] if argv is None else argv)  # what --devices starts each rank with
            from .cli_front import choose_model

            choose_model(args)  # --model or MODEL, else the demo model
            for name in COMMAND_IMPORTS.get(args.command, ()):
                import_module(name)
            if program:
                gc.freeze()  # what the imports made lives as long as the process: later collections skip it
                gc.enable()
            if guard is None:
                guard = SafeInterrupts()  # Ctrl-C raises KeyboardInterrupt, never inside the stdlib's lock handling
            return args.func(args)
        finally:
            if guard is not None:
                guard.restore()  # raises an interrupt still pending, caught below
    except KeyboardInterrupt:  # the engine was closed on the way out (its `with` block)
        try:
            sys.stdout.flush()
            print("\ninterrupted", file=sys.stderr)
            sys.stderr.flush()
        except (KeyboardInterrupt, OSError):  # a second Ctrl-C, or a closed stream: the status still says it
            pass
        if program:
            import os

            os._exit(130)
        return 130
    except OffloadEngineError as e:
        if args is not None and args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
