"""offload-engine run | serve | inspect | plan | probe | quantize: the thin dispatcher. Each subcommand's parser,
command and report live in offload_engine/frontend/ (one module each); main() takes Ctrl-C over first, parses,
imports what the command needs while an interrupt still ends the process at once, and runs it.

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

if TYPE_CHECKING:
    import argparse
    from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser, in the order `--help` lists them (they import torch: after main took Ctrl-C)."""
    from .frontend.common import FrontParser, version
    from .frontend.inspect import add_inspect_parser
    from .frontend.plan import add_plan_parser
    from .frontend.probe import add_probe_parser
    from .frontend.quantize import add_quantize_parser
    from .frontend.run import add_run_parser
    from .frontend.serve import add_serve_parser

    parser = FrontParser(prog="offload-engine", description="Run MoE and dense LLMs far larger than device memory.")
    parser.add_argument("--version", action="version", version=f"offload-engine {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_run_parser, add_inspect_parser, add_serve_parser, add_plan_parser, add_probe_parser,
                add_quantize_parser):
        add(sub)
    return parser


# what each command imports before it makes anything: imported while a Ctrl-C still ends the process at once
# (main). Only start-up time: under SafeInterrupts an import is never interrupted, its interrupt lands after it.
# Not listed: what build_parser's imports already made (frontend.inspect and checkpoint.model among them).
COMMAND_IMPORTS = {"run": ("offload_engine.api",),
                   "serve": ("offload_engine.api", "offload_engine.server.app", "uvicorn"),
                   "inspect": ("offload_engine.runtime.mtp",),
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
            from .frontend.common import choose_model

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
