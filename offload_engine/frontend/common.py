"""What every subcommand's parser shares: a parser that suggests the flag or subcommand meant, the model given as
`--model DIR` or a positional path alike (the demo model by default), --quiet / --debug, and `--version`.

Imported by the subcommand modules of frontend/ (and cli.main's choose_model), which cli.build_parser imports
after main took Ctrl-C: argparse and difflib stay out of the console script's first imports (cli.py).
"""
from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any, Sequence

from ..errors import ConfigError

# names other tools give these flags (the OpenAI API, llama.cpp, mlx-lm): suggested before difflib's guess
ALIASES = {"--max-tokens": "--max-new-tokens", "--n-predict": "--max-new-tokens", "-n": "--max-new-tokens",
           "--ctx-size": "--context", "-c": "--context", "--temp": "--temperature", "-m": "--model",
           "-p": "--prompt", "-t": "--threads"}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from .. import __version__

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


def add_common(p: argparse.ArgumentParser, quiet: str = "no progress bars") -> None:
    """--quiet and --debug, which every subcommand takes (main reads args.debug on an error)."""
    p.add_argument("--quiet", action="store_true", help=quiet)
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")


def bars(args: argparse.Namespace) -> bool:
    """Progress bars at all: a terminal on stderr and no --quiet."""
    return not args.quiet and sys.stderr.isatty()


def progress(args: argparse.Namespace) -> bool:
    """The loading bar: also off with --json (machine-read output)."""
    return bars(args) and not getattr(args, "json", False)


def subcommand(sub: Any, name: str, help: str, examples: str, **kwargs: Any) -> argparse.ArgumentParser:
    """One subcommand's parser, its examples printed as written after the flags."""
    return sub.add_parser(name, help=help, epilog=examples, formatter_class=argparse.RawDescriptionHelpFormatter,
                          **kwargs)


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
        from ..defaults import default_model_path

        args.model = str(default_model_path())
