"""`offload-engine plan`: its parser (shared with tools/plan.py), the planner's options from the flags, the
hardware to plan for (this machine by default, a profile, or a quick probe; --ram-total), the report, and the
exit status when the plan does not fit. `plan --ranks` is frontend/split.py."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..config import size_bytes
from ..constants import DEFAULT_CONTEXT, PREFILL_CHUNK
from ..errors import ConfigError, PlanError
from ..modes import DIRECT_IO_MODES, KV_DTYPES, PLAN_SPEC_MODES
from ..planner import costs
from ..planner.formats import FORMAT_BITS, WeightFormat, unit_bytes
from ..planner.hardware import THIS_MACHINE, HardwareProfile, load_profile, probe, ram_available, this_machine
from ..planner.kv import context_limit
from ..planner.plan import ModelShape, Plan, PlanOptions, load_model_spec, model_shape, plan
from ..planner.what_ifs import what_ifs
from .common import add_common, add_model_arguments, subcommand
from .plan_report import plan_json, plan_text
from .split import add_split_arguments, cmd_split

DOES_NOT_FIT = PlanError.exit_code  # `plan`'s status when the plan needs more memory than the hardware has
PLAN_EXAMPLES = f"""examples:
  offload-engine plan Qwen3-30B-A3B                          # on this machine (cores, RAM, GPU seen, not measured)
  offload-engine plan --model Qwen3-30B-A3B --ram-total 64GiB --context 8192
  offload-engine plan --model Qwen3-30B-A3B --hardware rtx4070-12gb --vram 10GiB --ram 48GiB
  offload-engine plan --model DeepSeek-V3 --hardware rtx4090-24gb --weights int4 --spec mtp --json
  offload-engine plan --model ~/models/Qwen3-30B-A3B --probe
models: the names in configs/models/ or a folder with config.json (default: the bundled model); hardware:
configs/hardware/ or a JSON file (default: this machine). Exit status: 0 the plan fits, {DOES_NOT_FIT} it does not
(the report still printed, the reason on stderr), 2 bad input.
"""


MODEL_HELP = "configs/models NAME, a folder with config.json, or a file"


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The planner's flags but the model (`plan`: common.add_model_arguments; tools/plan.py: its own --model)."""
    p.add_argument("--vram", help="device budget: 12GiB, 11000MB, or 10%% of the model's bytes (default: the "
                                  "profile's VRAM less a 0.75 GiB reserve and activations)")
    p.add_argument("--ram", help="host RAM budget, same forms (default: the profile's RAM less 2 GiB)")
    hw = p.add_mutually_exclusive_group()
    hw.add_argument("--hardware", help="profile NAME in configs/hardware or a JSON file (default: this machine, "
                                       "its cores, RAM and GPU as seen now, its rates estimated)")
    hw.add_argument("--probe", action="store_true", help="measure this machine (quick probe) and plan for it")
    p.add_argument("--ram-total", metavar="SIZE", help="the machine's RAM (e.g. 64GiB): plan for another amount "
                                                       "than the hardware's (this machine's, or the profile's)")
    p.add_argument("--context", type=int,
                   help=f"KV cache positions reserved (default: as `run`, {DEFAULT_CONTEXT} or the model's "
                        f"max_position_embeddings if fewer)")
    p.add_argument("--weights", choices=sorted(FORMAT_BITS),
                   help="weight format (default: the checkpoint's own, read from its quantization_config); fp8, "
                        "int8, int4: the units of a checkpoint in fp8 128x128 blocks, compressed-tensors int8 per "
                        "channel, int4 in groups of 32 (tools/make_checkpoint.py --quant fp8-block|ct-int8|ct-int4), "
                        "the embedding, head, norms and routers kept as stored")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="as `run`: the KV cache's storage, charged at its size (data + fp8/int8 scales)")
    p.add_argument("--cache-ram", default="0", metavar="SIZE|auto",
                   help="as `serve`: host RAM for saved prompt prefixes, charged to the RAM budget (default 0: none)")
    p.add_argument("--spec", default="off", choices=PLAN_SPEC_MODES, help="speculative decoding")
    p.add_argument("--accept", type=float, help="draft acceptance per position (default: mtp 0.85, ngram 0.35)")
    p.add_argument("--drafts", type=int, help="draft tokens per verify step (default: mtp layers, ngram 3)")
    p.add_argument("--trace", help="routing trace JSON: tools/trace_experts.py record's output, or "
                                   "{\"tokens\": [[[expert, ...] per MoE layer] per token]}")
    p.add_argument("--alpha", type=float, default=costs.DEFAULT_ALPHA,
                   help=f"expert locality (hits = cached fraction ** alpha; 1 = uniform routing; default "
                        f"{costs.DEFAULT_ALPHA})")
    p.add_argument("--recall", type=float, default=costs.DEFAULT_RECALL,
                   help="prefetch recall: share of expert reads issued a layer ahead (default 0, conservative; the "
                        "engine's prefetcher reports its measured recall in the run stats)")
    p.add_argument("--host-compute", action="store_true", help="compute experts resident in RAM on the CPU")
    p.add_argument("--direct-io", default="auto", choices=DIRECT_IO_MODES,
                   help="as `run`: O_DIRECT staging buffers; auto: on when the weights exceed --ram")
    p.add_argument("--position", type=int, help="tokens in the cache at the predicted step (default context/2)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help=f"as `run`: prompt tokens per forward, which sizes the activations (default {PREFILL_CHUNK})")
    p.add_argument("--overhead-scale", type=float, default=1.0,
                   help="multiply the per-op and per-unit software costs (0: the bound the hardware sets)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    p = subcommand(sub, "plan", "plan placement and predict decode speed from config.json alone", PLAN_EXAMPLES)
    add_model_arguments(p, MODEL_HELP)  # the demo model by default (common.choose_model)
    add_plan_arguments(p)
    add_split_arguments(p)
    add_common(p, "no progress output")
    p.set_defaults(func=cmd_plan)
    return p


# ---- plan ----------------------------------------------------------------------------------------------------
def resolve_profile(args: argparse.Namespace) -> HardwareProfile:
    """--hardware NAME|FILE; --probe: a quick probe, reading back a scratch file in the model's folder when it is
    one (its disk); neither: this machine as seen (hardware.this_machine). --ram-total replaces its RAM."""
    if getattr(args, "probe", False):
        folder = Path(args.model or ".").expanduser()
        disk = folder if folder.is_dir() else folder.parent if folder.is_file() else Path(".")  # a .gguf: its disk
        profile = probe(disk, read_bytes=256 << 20, quick=True)
    else:
        profile = load_profile(args.hardware) if args.hardware else this_machine()
    total = size_bytes(getattr(args, "ram_total", None), "--ram-total", 0)
    if total is not None:
        if total <= 0:
            raise ConfigError(f"--ram-total must be a positive size, got {args.ram_total!r}")
        profile = profile.with_changes(ram_bytes=total, description=f"{profile.description}; RAM set by "
                                                                    f"--ram-total {args.ram_total}")
    return profile


def options_from_args(args: argparse.Namespace, shape: ModelShape) -> PlanOptions:
    fmt = WeightFormat.of(shape.spec, args.weights)
    total = sum(unit_bytes(k, v, fmt) for k, v in shape.schema.units.items())
    trace = None
    if args.trace:
        try:
            trace = json.loads(Path(args.trace).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--trace {args.trace}: {e}") from None
    context = args.context if args.context is not None else min(shape.spec.max_position_embeddings, DEFAULT_CONTEXT)
    if context < 1:
        raise ConfigError(f"--context must be >= 1, got {args.context}")
    if args.prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    return PlanOptions(vram=size_bytes(args.vram, "--vram", total), ram=size_bytes(args.ram, "--ram", total),
                       context=context, weights=args.weights, spec=args.spec, recall=args.recall,
                       alpha=args.alpha, host_compute=args.host_compute, position=args.position, trace=trace,
                       direct_io=args.direct_io, accept=args.accept, drafts=args.drafts,
                       overhead_scale=args.overhead_scale, prefill_chunk=args.prefill_chunk,
                       kv_dtype=args.kv_dtype, cache_ram=getattr(args, "cache_ram", 0))


def build_plan(args: argparse.Namespace) -> tuple[Plan, list]:
    shape = model_shape(load_model_spec(args.model))
    profile = resolve_profile(args)
    p = plan(shape, profile, options_from_args(args, shape))
    limit = context_limit(shape.spec)
    if args.context is not None and args.context > limit:
        p.warnings.append(f"--context {args.context} exceeds the {limit} positions the model supports (`run` "
                          f"refuses it)")
    free = ram_available()
    host = p.placement.tiers[-1]
    if (profile.name == THIS_MACHINE and args.ram is None and getattr(args, "ram_total", None) is None
            and host.budget is not None and host.budget > free):
        p.warnings.append(f"only {_gib(free)} of this machine's {_gib(profile.ram_bytes)} of RAM are available now; "
                          f"`run` without --ram fits what is available, so it will cache less than this plan")
    return p, what_ifs(p)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def cmd_plan(args: argparse.Namespace) -> int:
    if getattr(args, "ranks", None):  # the layers split over pipeline ranks
        return cmd_split(args, args.hardware or resolve_profile(args))
    p, ifs = build_plan(args)
    print(json.dumps(plan_json(p, ifs), indent=2) if args.json else plan_text(p, ifs))
    misfit = [m for m, (need, have) in p.fit.items() if need > have]
    if misfit:  # the report says why (plan() words it as a warning): repeated on stderr with the status
        reasons = [next((w for w in p.warnings if w.startswith(f"{m}: ")), f"{m} short") for m in misfit]
        sys.stdout.flush()
        print(f"error: the plan does not fit {p.profile.name}: " + "; ".join(reasons), file=sys.stderr)
        return DOES_NOT_FIT
    return 0
