"""`offload-engine probe`: measure this machine (disk, RAM, CPU, and CUDA where present) and write a hardware
profile `plan --hardware FILE` takes."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..config import size_bytes
from ..errors import ConfigError
from ..planner.hardware import probe, save_profile
from .common import add_common, subcommand

PROBE_EXAMPLES = """examples:
  offload-engine probe --out configs/hardware/this-machine.json
  offload-engine probe --dir /nvme/models --size 4GiB --json
"""


def add_probe_parser(sub: Any) -> argparse.ArgumentParser:
    p = subcommand(sub, "probe", "measure this machine and write a hardware profile", PROBE_EXAMPLES)
    p.add_argument("--out", help="write the profile here (JSON); usable as --hardware FILE")
    p.add_argument("--dir", default=".", help="where to write the scratch file read back with O_DIRECT "
                                              "(put it on the disk that holds the models; default .)")
    p.add_argument("--size", default="1GiB", help="scratch file size (default 1GiB)")
    p.add_argument("--name", help="profile name (default: the host name)")
    p.add_argument("--quick", action="store_true", help="smaller measurements (seconds)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    add_common(p, "no progress output")
    p.set_defaults(func=cmd_probe)
    return p


def cmd_probe(args: argparse.Namespace) -> int:
    size = size_bytes(args.size, "--size", 0)
    if not Path(args.dir).is_dir():
        raise ConfigError(f"--dir {args.dir}: not a directory")
    if not args.quiet and not args.json:
        print(f"probing: {args.size} scratch file in {Path(args.dir).resolve()}, RAM, CPU"
              f" (and CUDA if present)...", file=sys.stderr)
    profile = probe(args.dir, name=args.name, read_bytes=size, quick=args.quick)
    if args.out:
        path = save_profile(profile, args.out)
        if not args.json:
            print(f"profile written: {path}")
    print(json.dumps(profile.to_dict(), indent=2) if args.json else profile.describe())
    return 0
