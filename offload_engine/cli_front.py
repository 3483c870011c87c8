"""The CLI's front door (cli.py builds the parser with it): a parser that suggests the flag or subcommand meant,
the model given as `--model DIR` or a positional path alike (the demo model by default), `--prompt -` from stdin,
`--context` checked against the model's positions, `--version`, and the examples each --help shows (every one
run by tests/test_cli_front_door.py).

Imported by cli.build_parser only: argparse and difflib stay out of the console script's first imports (cli.py).
"""
from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import ConfigError, OffloadEngineError

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
INSPECT_EXAMPLES = """examples:
  offload-engine inspect ~/models/Qwen3-30B-A3B
  offload-engine inspect --model DIR --json
"""
# names other tools give these flags (the OpenAI API, llama.cpp, mlx-lm): suggested before difflib's guess
ALIASES = {"--max-tokens": "--max-new-tokens", "--n-predict": "--max-new-tokens", "-n": "--max-new-tokens",
           "--ctx-size": "--context", "-c": "--context", "--temp": "--temperature", "-m": "--model",
           "-p": "--prompt", "-t": "--threads"}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from . import __version__

    try:
        return installed("offload-engine")
    except PackageNotFoundError:  # run from a checkout without installing
        return __version__


class FrontParser(argparse.ArgumentParser):
    """An ArgumentParser that names the flag or choice meant when one is mistyped (Python 3.14's suggest_on_error,
    for every Python here), and reports a subcommand's unknown flags with that subcommand's usage (argparse's own
    gives the top-level usage, which lists none of them)."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen(ns)
            parser.error(unrecognized(extras, parser))
        return ns

    def _chosen(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(ns, action.dest, None)
                if name in action.choices:
                    return action.choices[name]
        return self

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            close = difflib.get_close_matches(str(value), [str(c) for c in action.choices or ()], n=1)
            if close and "did you mean" not in e.message and "maybe you meant" not in e.message:
                raise argparse.ArgumentError(action, f"{e.message}; did you mean {close[0]!r}?") from None
            raise


def suggest(flag: str, parser: argparse.ArgumentParser) -> str | None:
    """The flag of `parser` closest to a mistyped one (an alias, the same with '-' for '_', or difflib's)."""
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    name = flag.split("=", 1)[0]
    alias = ALIASES.get(name)
    if alias in known:
        return alias
    dashed = "--" + name.lstrip("-").replace("_", "-")
    if dashed in known:
        return dashed
    close = difflib.get_close_matches(dashed, known, n=1, cutoff=0.6)
    return close[0] if close else None


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    hints = []
    for arg in extras:
        if arg.startswith("-") and (meant := suggest(arg, parser)):
            hints.append(f"{arg.split('=', 1)[0]}: did you mean {meant}?")
    if any(not a.startswith("-") for a in extras) and "--prompt" in parser._option_string_actions:
        hints.append('the prompt goes in --prompt "..." (or --prompt - to read it from stdin)')
    return "unrecognized arguments: " + " ".join(extras) + "".join(f"; {h}" for h in hints)


# ---- the model: --model DIR or a positional path ---------------------------------------------------------------
def add_model_arguments(p: argparse.ArgumentParser, what: str, default: bool = True) -> None:
    """MODEL as a positional path or --model alike (choose_model reconciles them after parsing)."""
    p.add_argument("model_path", nargs="?", metavar="MODEL", help=f"{what}; the same as --model")
    p.add_argument("--model", help=what + ("; default: the bundled demo model" if default else ""))


def choose_model(args: argparse.Namespace) -> None:
    """args.model from --model or the positional MODEL (the same one if both), else the demo model."""
    if not hasattr(args, "model_path"):
        return
    given, flag = args.model_path, args.model
    if given is not None and flag is not None and given != flag:
        raise ConfigError(f"the model is given twice, as {given} and as --model {flag}: give one")
    args.model = flag if flag is not None else given
    if args.model is None:
        from .defaults import default_model_path

        args.model = str(default_model_path())


# ---- run's prompt and context ------------------------------------------------------------------------------------
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


def check_context(model: str | Path, context: int | None) -> None:
    """--context beyond the positions the model supports (max_position_embeddings, or more where its rope scaling
    stretches it) is refused before anything loads. A model whose config cannot be read here is left to
    Engine.open, which reports it."""
    if context is None:
        return
    if context < 1:
        raise ConfigError(f"--context must be >= 1, got {context}")
    from .planner.commands import context_limit
    from .planner.plan import gguf_model_spec, load_model_spec

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


def grammar_of(args: argparse.Namespace) -> Any:
    """--grammar FILE (Lark) or --json-schema FILE|JSON as a Grammar; None without either."""
    from .generate.grammar import Grammar

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
