"""The `plan` and `probe` subcommands (registered by cli.py), and what tools/plan.py adds: --calibrate against a
bench JSON and the SCALE.md table. Each command parses, calls the planner, and prints."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from ..constants import DEFAULT_CONTEXT, PREFILL_CHUNK
from ..errors import ConfigError, PlanError
from ..modes import DIRECT_IO_MODES, KV_DTYPES, PLAN_SPEC_MODES
from ..units import parse_bytes
from . import costs
from .formats import FORMAT_BITS, WeightFormat, unit_bytes
from .hardware import (THIS_MACHINE, HardwareProfile, load_profile, probe, ram_available, save_profile,
                       this_machine)
from .plan import ModelShape, Plan, PlanOptions, load_model_spec, model_shape, plan
from .report import plan_json, plan_text
from .split_report import add_split_arguments, cmd_split
from .what_ifs import what_ifs  # noqa: F401 (tools and tests import it from here)

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
PROBE_EXAMPLES = """examples:
  offload-engine probe --out configs/hardware/this-machine.json
  offload-engine probe --dir /nvme/models --size 4GiB --json
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")


def add_plan_arguments(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument("--model", required=model_required, help="configs/models NAME, a folder with config.json, or a file"
                   + ("" if model_required else " (default: the bundled model)"))
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


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="plan placement and predict decode speed from config.json alone",
                              epilog=PLAN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_path", nargs="?", metavar="MODEL", help="as --model (either form)")
    add_plan_arguments(p, model_required=False)  # the demo model by default (cli_front.choose_model)
    add_split_arguments(p)
    _common(p)
    p.set_defaults(func=cmd_plan)
    return p


def add_probe_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("probe", help="measure this machine and write a hardware profile",
                              epilog=PROBE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the profile here (JSON); usable as --hardware FILE")
    p.add_argument("--dir", default=".", help="where to write the scratch file read back with O_DIRECT "
                                              "(put it on the disk that holds the models; default .)")
    p.add_argument("--size", default="1GiB", help="scratch file size (default 1GiB)")
    p.add_argument("--name", help="profile name (default: the host name)")
    p.add_argument("--quick", action="store_true", help="smaller measurements (seconds)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    _common(p)
    p.set_defaults(func=cmd_probe)
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
    total = _size(getattr(args, "ram_total", None), "--ram-total", 0)
    if total is not None:
        if total <= 0:
            raise ConfigError(f"--ram-total must be a positive size, got {args.ram_total!r}")
        profile = profile.with_changes(ram_bytes=total, description=f"{profile.description}; RAM set by "
                                                                    f"--ram-total {args.ram_total}")
    return profile


def _size(value: str | None, flag: str, total: int) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value, what=flag, total=total)
    except ValueError as e:
        raise ConfigError(str(e)) from None


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
    return PlanOptions(vram=_size(args.vram, "--vram", total), ram=_size(args.ram, "--ram", total),
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


def context_limit(spec: Any) -> int:
    """The positions a model supports: max_position_embeddings, or the original length times the rope scaling's
    factor where a scaling stretches it further (YaRN, llama3, longrope, linear, dynamic)."""
    limit = spec.max_position_embeddings
    params = spec.rope.params
    if spec.rope.rope_type != "default" and isinstance(params.get("factor"), (int, float)):
        original = params.get("original_max_position_embeddings") or limit
        limit = max(limit, int(original * params["factor"]))
    return limit


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


def cmd_probe(args: argparse.Namespace) -> int:
    size = _size(args.size, "--size", 0)
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


# ---- calibration against tools/bench.py ------------------------------------------------------------------------
def bench_runs(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """(budget_pct, engine run) pairs of a bench JSON: `rows[*].engine` (+ `resident`), or a plain list."""
    rows = bench.get("rows") if isinstance(bench, dict) else bench
    runs = [r.get("engine", r) | {"budget_pct": r.get("budget_pct")} for r in rows or [] if isinstance(r, dict)]
    if isinstance(bench, dict) and isinstance(bench.get("resident"), dict):
        runs.insert(0, bench["resident"] | {"budget_pct": None})
    if not runs:
        raise ConfigError("bench JSON: no runs found (expected rows[*].budget_pct and rows[*].engine)")
    return runs


def profile_from_bench(bench: dict[str, Any]) -> HardwareProfile:
    """The bench's own probe (disk at unit size x 4 threads, memcpy, CPU GEMM) + GEMV/op latency measured now."""
    from .hardware import measure_gemv, ram_total

    pr = bench.get("probe") or {}
    disks = [d for d in pr.get("disk", []) if d.get("threads") == 4] or pr.get("disk", [])
    if not disks or "memcpy" not in pr:
        raise ConfigError("bench JSON has no probe section: pass --hardware FILE (offload-engine probe --out FILE)")
    disk = sorted(d["bytes_per_s"] for d in disks)[len(disks) // 2]
    gemv, op = measure_gemv("cpu")
    return HardwareProfile(name="bench-probe", description="from the bench's probe + GEMV measured now",
                           vram_bytes=0, ram_bytes=ram_total(), gpu_mem_gbps=0, gpu_tflops=0, pcie_gbps=0,
                           ram_gbps=pr["memcpy"]["bytes_per_s"] / 1e9, cpu_gemv_gbps=gemv,
                           cpu_gflops=pr.get("cpu_matmul", {}).get("flops_per_s", 5e10) / 1e9,
                           nvme_gbps=disk / 1e9, cpu_op_us=op, sources={"all": "tools/bench.py probe section"})


def expert_hit_rate(p: Plan, overall: float) -> float:
    """The engine reports hits over every compute-tier acquisition; keep the experts' share (the planner's
    non-expert hits are exact: pinned or scanned)."""
    flows = {k: v for k, v in p.hits["expected"].items()}
    s = p.shape.spec
    counts = {"embed": 1, "head": 1, "dense": s.num_layers}
    non_hits = sum(n * flows[k][0] for k, n in counts.items() if k in flows)
    experts = len(p.shape.moe_layers) * s.num_experts_per_tok
    total = sum(counts.values()) + experts
    return min(max((overall * total - non_hits) / experts, 0.0), 1.0) if experts else overall


def calibrate(bench: dict[str, Any], model: str | None, profile: HardwareProfile | None,
              alpha: float = 1.0, trace: Any = None) -> tuple[list[dict[str, Any]], str]:
    """Plan every run of a bench JSON and compare with its measured decode speed. `trace`: a routing trace
    (tools/trace_experts.py's record) for the expected hit rates instead of the locality assumption `alpha`."""
    model = model or (bench.get("model") or {}).get("path")
    if not model:
        raise ConfigError("bench JSON names no model path: pass --model DIR")
    profile = profile or profile_from_bench(bench)
    shape = model_shape(load_model_spec(model))
    settings = bench.get("settings") or {}
    prompt, tokens = settings.get("prompt_len", 32), settings.get("tokens", 32)
    total = sum(unit_bytes(k, v, WeightFormat.of(shape.spec, None)) for k, v in shape.schema.units.items())
    rows = []
    for run in bench_runs(bench):
        pct = run.get("budget_pct")
        measured = run.get("decode_tok_s", run.get("tok_s"))
        # the share of expert reads the prefetcher issued ahead (its prediction recall times the share of forwards
        # it prefetched in: the pay check turns it off where it does not pay); older JSON: the recall alone
        pf = run.get("prefetch") or {}
        recall = pf.get("recall_effective", pf.get("recall")) or 0.0
        # as the run: its direct I/O when it says (tools/calibrate.py, bench's EngineRun), else bench's rule
        direct = run.get("direct_io")
        direct_io = ("on" if direct else "off") if direct is not None else (
            "auto" if pct is None or pct >= 100 else "on")
        budget = None if pct is None else int(total * pct / 100)  # as Budget("PCT%").resolve
        # the budgeted tier: RAM (bench, the CPU engine) or VRAM (tools/calibrate.py on CUDA; RAM unlimited)
        tiers = {"vram": budget, "ram": 10 * total} if run.get("tier") == "vram" else {"ram": budget}
        opts = PlanOptions(**tiers, context=prompt + tokens + 8, position=prompt + tokens // 2, alpha=alpha,
                           recall=recall, direct_io=direct_io, trace=trace)
        if pct is None:
            opts = PlanOptions(ram=10 * total, context=opts.context, position=opts.position, alpha=alpha,
                               trace=trace)
        base = plan(shape, profile, opts)
        row = {"budget_pct": pct, "measured_tok_s": measured, "predicted_tok_s": base.expected,
               "ratio": base.expected / measured if measured else None,
               "bottleneck": base.steps["expected"].bottleneck, "hit_rate_measured": run.get("hit_rate"),
               "others_cpu": run.get("others_cpu"), "disk_mb_measured": _mb(run.get("bytes_read_disk_per_token")),
               "disk_mb_predicted": _mb(base.steps["expected"].bytes_disk)}
        if run.get("hit_rate") is not None and shape.moe_layers:
            hit = expert_hit_rate(base, run["hit_rate"])
            with_hits = plan(shape, profile, PlanOptions(**{**opts.__dict__, "stats": {"expert_hit_rate": hit}}))
            row.update(expert_hit_rate=hit, predicted_with_measured_hits=with_hits.expected,
                       disk_mb_predicted_with_hits=_mb(with_hits.steps["expected"].bytes_disk))
        row["within_25pct"] = row["ratio"] is not None and abs(row["ratio"] - 1) <= CALIBRATION_TOLERANCE
        rows.append(row)
    locality = "a routing trace" if trace is not None else f"alpha {alpha:g}"
    lines = [f"calibration: {model} on {profile.name} ({locality} for the locality prediction)",
             f"{'budget':>8} {'measured':>10} {'predicted':>10} {'error':>8} {'ratio':>6} {'w/ hits':>10} "
             f"{'error':>8} {'others':>7} {'disk MB/token: measured / predicted / w/ hits':>46}  bottleneck"]
    for r in rows:
        m = r["measured_tok_s"]
        err = lambda x: f"{100 * (x - m) / m:+7.1f}%" if m and x is not None else "       -"  # noqa: E731
        w = r.get("predicted_with_measured_hits")
        label = "resident" if r["budget_pct"] is None else f"{r['budget_pct']:g}%"
        ratio = f"{r['ratio']:6.2f}" if r["ratio"] is not None else "     -"
        lines.append(f"{label:>8} {m or 0:>10.2f} {r['predicted_tok_s']:>10.2f} {err(r['predicted_tok_s'])} {ratio} "
                     f"{w if w is not None else float('nan'):>10.2f} {err(w)} {_others(r['others_cpu'])} "
                     f"{_fmt(r['disk_mb_measured']):>22} / {_fmt(r['disk_mb_predicted']):>8} / "
                     f"{_fmt(r.get('disk_mb_predicted_with_hits')):>8}  {r['bottleneck']}")
    if any((r["others_cpu"] or 0) > CONTENDED for r in rows):
        lines.append(f"*: other processes used > {CONTENDED:g} cores during the run; its measurement is not a "
                     f"calibration point (rerun on a quiet machine)")
    return rows, "\n".join(lines)


CONTENDED = 0.25  # cores used by other processes during a bench run (bench's others_cpu)
CALIBRATION_TOLERANCE = 0.25  # the check: predicted decode tok/s within +-25% of the measured engine


def _mb(x: float | None) -> float | None:
    return None if x is None else round(x / 1e6, 2)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _others(x: float | None) -> str:
    return "      -" if x is None else f"{x:6.2f}{'*' if x > CONTENDED else ' '}"


# ---- the SCALE.md table ------------------------------------------------------------------------------------
SCALE_MODELS = ("Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "Qwen3-Next-80B-A3B", "gpt-oss-120b", "Mixtral-8x7B",
                "Llama-3.1-70B", "Qwen3-235B-A22B", "DeepSeek-V3", "Kimi-K2")
SCALE_PROFILES = ("rtx4070-12gb", "rtx4090-24gb", "v100-16gb-pcie3")
SCALE_WEIGHTS = ("bf16", "fp8", "int4")


def scale_rows(models: Sequence[str] = SCALE_MODELS, profiles: Sequence[str] = SCALE_PROFILES,
               weights: Sequence[str] = SCALE_WEIGHTS, context: int | None = DEFAULT_CONTEXT) -> list[dict[str, Any]]:
    context = context or DEFAULT_CONTEXT  # tools/plan.py --scale-table without --context
    rows = []
    for name in models:
        shape = model_shape(load_model_spec(name))
        for prof_name in profiles:
            prof = load_profile(prof_name)
            for w in weights:
                row: dict[str, Any] = {"model": name, "hardware": prof_name, "weights": w}
                try:
                    p = plan(shape, prof, PlanOptions(context=context, weights=w))
                except Exception as e:  # a refused plan is a row too
                    rows.append(row | {"error": str(e).split(" (hint")[0]})
                    continue
                j = plan_json(p)
                ex = j["placement"]["summary"].get("expert", {}).get("tiers", {})
                bound = plan(shape, prof, PlanOptions(context=context, weights=w, overhead_scale=0.0))
                row.update(bytes=p.bytes_total, dense_home=p.placement.home("dense"), bound=bound.tok_s,
                           experts_vram_pct=ex.get("device", {}).get("pct", 0.0),
                           experts_ram_pct=ex.get("host", {}).get("pct", 0.0),
                           tok_s=j["predicted_tok_s"], bottleneck=j["bottleneck"], warnings=p.warnings)
                rows.append(row)
    return rows


def scale_markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| model | hardware | weights | weights GiB | dense in | experts VRAM / RAM | no hits | expected | "
           "all hits | hardware bound (expected / all hits) | bottleneck (expected) |",
           "|---|---|---|---:|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['hardware']} | {r['weights']} | | refused | {r['error'][:90]} | | | | | |")
            continue
        t = r["tok_s"]
        out.append(f"| {r['model']} | {r['hardware']} | {r['weights']} | {r['bytes'] / 2**30:.1f} | "
                   f"{r['dense_home']} | {r['experts_vram_pct']:.1f}% / {r['experts_ram_pct']:.1f}% | "
                   f"{t['no_hits']:.2f} | {t['expected']:.2f} | {t['all_hits']:.2f} | "
                   f"{r['bound']['expected']:.1f} / {r['bound']['all_hits']:.1f} | {r['bottleneck']} |")
    return "\n".join(out)
