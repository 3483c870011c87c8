#!/usr/bin/env python3
"""The memory planner from a checkout: the same code as `offload-engine plan`, plus two reports.

    python tools/plan.py --model Qwen3-30B-A3B --vram 12GiB --ram 64GiB --context 8192
    python tools/plan.py --calibrate bench-out/bench.json [--hardware FILE]   # predicted vs measured decode tok/s
    (tools/calibrate.py does it all in one command: probe, bench checkpoint, engine at 100/25/10%, this comparison)
    python tools/plan.py --scale-table                                        # the table in docs/SCALE.md

--calibrate reads a tools/bench.py JSON (rows[*].budget_pct, rows[*].engine.tok_s or .decode_tok_s, and
hit_rate): each budget is replanned as the bench ran it (--ram PCT% of the checkpoint on the CPU engine,
O_DIRECT below 100%) and predicted twice: with --alpha locality (default 1: uniform routing, right for random
weights) and with the engine's measured hit rate. Without --hardware the bench's own probe section is used.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_engine.errors import OffloadEngineError  # noqa: E402
from offload_engine.frontend import calibrate as calibration  # noqa: E402
from offload_engine.frontend import plan as commands  # noqa: E402
from offload_engine.planner.hardware import load_profile  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tools/plan.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=commands.MODEL_HELP)
    commands.add_plan_arguments(ap)
    ap.add_argument("--calibrate", metavar="BENCH_JSON", help="compare predictions with a tools/bench.py result")
    ap.add_argument("--scale-table", action="store_true", help="print the docs/SCALE.md table (markdown)")
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    if not (args.model or args.calibrate or args.scale_table):
        ap.error("give --model, --calibrate or --scale-table")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.scale_table:
            rows = calibration.scale_rows(context=args.context)
            print(json.dumps(rows, indent=2) if args.json else calibration.scale_markdown(rows))
        elif args.calibrate:
            bench = json.loads(Path(args.calibrate).read_text())
            profile = load_profile(args.hardware) if args.hardware else None
            alpha = 1.0 if "--alpha" not in (argv if argv is not None else sys.argv) else args.alpha
            rows, table = calibration.calibrate(bench, args.model, profile, alpha)
            print(json.dumps(rows, indent=2) if args.json else table)
        else:
            return commands.cmd_plan(args)
    except OffloadEngineError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
