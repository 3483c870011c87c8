"""`offload-engine run`: its parser (the common flags first, the expert ones under headings), the prompt (`--prompt
-` from stdin), `--context` checked against the model's positions, the generation loop and the --stats line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..units import format_bytes
from .common import add_common, add_model_arguments, bars, subcommand
from .engine_flags import add_engine_flags, check_context, check_engine_flags, engine_config, started_as_rank

RUN_EXAMPLES = """examples:
  offload-engine run --prompt "def fibonacci(n):"
  offload-engine run ~/models/Qwen3-30B-A3B --ram 48GiB --prompt "Hello" --max-new-tokens 64 --stats
  offload-engine run --model DIR --prompt "Once upon a time" --temperature 0.7 --top-p 0.9 --seed 1 --json
  echo "Summarize: ..." | offload-engine run --model DIR --prompt -
  offload-engine run --model ~/models/DeepSeek-V3 --vram 24GiB --ram 200GiB --spec mtp --prompt "..."
  offload-engine run --model DIR --spec draft --draft-model ~/models/Qwen3-0.6B --draft-ram 2GiB --prompt "..."

speculative decoding (--spec): output is identical to plain decoding (greedy) or has the same distribution
(sampling). auto lets a cost model pick the drafter, the draft depth and width each step from the measured
acceptance and the bytes of experts a verification pass would read, and skips drafting when it would lose.
"""


def add_run_parser(sub: Any) -> argparse.ArgumentParser:
    run = subcommand(sub, "run", "generate text", RUN_EXAMPLES,
                     usage="offload-engine run [MODEL | --model DIR] --prompt TEXT [options]")
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
    add_common(run)
    add_engine_flags(run)
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
    return run


def cmd_run(args: argparse.Namespace) -> int:
    from ..api import Engine

    check_engine_flags(args)
    model = args.model  # common.choose_model filled it in (the demo model by default)
    read_prompt(args)
    check_context(model, args.context)
    ranked = args.devices or started_as_rank()  # pipeline ranks: rank 0 generates and prints, the others serve it
    if ranked:
        from ..distributed.command import run_ranked, this_ranks_share

        args.ram, args.vram = this_ranks_share(args.ram, "--ram"), this_ranks_share(args.vram, "--vram")
        if args.devices and not started_as_rank():
            args.ram = args.vram = None  # the launcher itself loads nothing: its ranks take their shares
    config = engine_config(args)
    if ranked:
        return run_ranked(model, config, args.devices, args.argv, lambda engine: generate(engine, args),
                          split=args.split)
    # not `with Engine.open(...)`: a Ctrl-C landing in __enter__ would skip __exit__; nothing can interrupt
    # between this assignment and the `try`
    engine = Engine.open(model, config)
    try:
        return generate(engine, args)
    finally:
        engine.close()


def generate(engine: Any, args: argparse.Namespace) -> int:
    import json

    from ..generate.decoder import FinishEvent

    if args.show_plan:
        print(engine.placement.describe(), file=sys.stderr)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
                    grammar=grammar_of(args))
    finish = None
    # --json holds the text back until the end: a progress bar on stderr (terminals only) shows it is working
    bar = _token_bar(args.max_new_tokens) if args.json and bars(args) else None
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


# ---- run's prompt, context and grammar ---------------------------------------------------------------------------
def read_prompt(args: argparse.Namespace) -> None:
    """--prompt -: the prompt is stdin, read to its end as it is (mlx-lm's rule). args.argv gets the text, for the
    ranks --devices starts, which cannot read this process's stdin."""
    if args.prompt != "-":
        return
    text = sys.stdin.read()
    if not text:
        raise ConfigError("--prompt -: stdin is empty (pipe the prompt in, or give it as --prompt \"...\")")
    argv = getattr(args, "argv", None) or []
    for i, arg in enumerate(argv):
        if arg == "--prompt=-" or (arg == "--prompt" and i + 1 < len(argv) and argv[i + 1] == "-"):
            argv[i:i + (1 if "=" in arg else 2)] = ["--prompt", text]
            break
    args.prompt = text


def grammar_of(args: argparse.Namespace) -> Any:
    """--grammar FILE (Lark) or --json-schema FILE|JSON as a Grammar; None without either."""
    from ..generate.grammar import Grammar

    if args.grammar is not None and args.json_schema is not None:
        raise ConfigError("--grammar and --json-schema: give one of them")
    if args.grammar is not None:
        if not Path(args.grammar).is_file():
            raise ConfigError(f"--grammar {args.grammar}: no such file (a Lark grammar, e.g. start: \"yes\" | \"no\")")
        return Grammar.lark(Path(args.grammar).read_text(encoding="utf-8"), name=f"--grammar {args.grammar}")
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            if not Path(text).is_file():
                raise ConfigError(f"--json-schema {text}: no such file, and not an inline JSON object")
            text = Path(text).read_text(encoding="utf-8")
        return Grammar.json_schema(text, name=f"--json-schema {args.json_schema}")
    return None
