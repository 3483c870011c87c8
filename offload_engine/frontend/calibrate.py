"""What tools/plan.py adds to `plan` (and tools/calibrate.py uses): the planner against a bench JSON's measured
runs (--calibrate), and the SCALE.md table of models x hardware x weight formats."""
from __future__ import annotations

from typing import Any, Sequence

from ..constants import DEFAULT_CONTEXT
from ..errors import ConfigError
from ..planner.formats import WeightFormat, unit_bytes
from ..planner.hardware import HardwareProfile, load_profile
from ..planner.plan import Plan, PlanOptions, load_model_spec, model_shape, plan
from .plan_report import plan_json


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
    from ..planner.hardware import measure_gemv, ram_total

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
        budget = None if pct is None else int(total * pct / 100)  # as assemble.resolve_budget does "PCT%"
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
