"""tools/bench.py's tables and plots: one line per budget against the bounds, the prefetch modes compared, and
the speed / bytes-read plots."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.bench_common import MB, EngineRun, Row

def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row], resident: EngineRun, physical: dict[str, Any] | None = None) -> str:
    """One line per budget. 'pc': accelerate with the page cache allowed; 'disk': the O_DIRECT bandwidth of the
    row's bound (probed around its engine runs), 'read': what the engine's reads got while any was in flight;
    'others': the most cores other processes used during any of the row's measured decodes (a shared machine's
    noise); 'phys': the physical bound (tools/bench_physical.py: max(active bytes / memory read bandwidth,
    bytes read and used / O_DIRECT bandwidth)) and '/phys' the engine's time per token against it."""
    lines = [f"{'budget':>7} {'engine':>7} {'peer':>7} {'ratio':>6} {'peer pc':>7} {'ratio':>6} {'MB/tok':>7} "
             f"{'hits':>5} {'stall':>7} {'disk':>5} {'read':>5} {'/bound':>6} {'rounds':>9} {'phys':>6} {'/phys':>5} "
             f"{'others':>6}  tokens",
             f"{'% model':>7} {'tok/s':>7} {'bypass':>7} {'':>6} {'tok/s':>7} {'':>6} {'engine':>7} "
             f"{'%':>5} {'ms/tok':>7} {'GB/s':>5} {'GB/s':>5} {'':>6} {'/bound':>9} {'ms/tok':>6} {'':>5} {'cores':>6}"]
    for r in rows:
        by, pc = r.peers.get("bypass"), r.peers.get("allow")
        ok = all(r.tokens_match.values()) if r.tokens_match else None
        others = max([r.engine.others_cpu] + [p.others_cpu for p in r.peers.values()])
        lines.append(
            f"{r.budget_pct:>7g} {r.engine.tok_s:>7.2f} {_fmt(by and by.tok_s, '7.2f'):>7} "
            f"{_fmt(r.ratio('bypass'), '6.1f'):>6} {_fmt(pc and pc.tok_s, '7.2f'):>7} "
            f"{_fmt(r.ratio('allow'), '6.2f'):>6} "
            f"{r.engine.bytes_read_disk_per_token / MB:>7.1f} {100 * r.engine.hit_rate:>5.1f} "
            f"{1e3 * r.engine.stall_s_per_token:>7.1f} {r.disk_bw / 1e9:>5.2f} "
            f"{_fmt(r.engine.read_bytes_per_busy_s and r.engine.read_bytes_per_busy_s / 1e9, '5.2f'):>5} "
            f"{r.engine_vs_bound:>6.2f} {_spread(r.rounds_vs_bound):>9} "
            f"{_fmt(r.physical and 1e3 * r.physical['s_per_token'], '6.1f'):>6} "
            f"{_fmt(r.physical and r.physical['measured_vs_bound'], '5.2f'):>5} {others:>6.2f}  "
            f"{'-' if ok is None else 'match' if ok else 'MISMATCH'}")
    lines.append(f"resident compute: {resident.s_per_token * 1e3:.1f} ms/token ({resident.tok_s:.2f} tok/s) first; "
                 f"before-after each budget {' '.join(_around(r) for r in rows)}; O_DIRECT GB/s before-after each "
                 f"budget {' '.join(f'{a / 1e9:.2f}-{b / 1e9:.2f}' for a, b in (r.disk_around for r in rows))}")
    if physical:
        lines.append(f"physical: {physical['active_bytes']['per_token'] / MB:.1f} MB active per token / "
                     f"{physical['memory_read']['bytes_per_s'] / 1e9:.2f} GB/s memory read = "
                     f"{1e3 * physical['resident_bound_s_per_token']:.1f} ms/token; resident engine "
                     f"{physical['resident_engine_vs_physical']:.2f}x that")
    return "\n".join(lines)


def _spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else "-"


def _around(r: Row) -> str:
    before, after = r.resident_around
    return f"{before * 1e3:.1f}-{after * 1e3:.1f}"


def prefetch_table(runs: dict[float, dict[str, EngineRun]]) -> str:
    """Per budget and prefetch mode, against the same budget's prefetch-off run."""
    lines = [f"{'budget':>7} {'prefetch':>9} {'tok/s':>7} {'vs off':>6} {'stall':>7} {'off/this':>8} {'MB/tok':>7} "
             f"{'wasted':>7} {'ahead':>6} {'RA':>6} {'overlap':>7}  pay-check verdicts",
             f"{'% model':>7} {'':>9} {'':>7} {'':>6} {'ms/tok':>7} {'stall':>8} {'read':>7} {'MB/tok':>7} "
             f"{'reads':>6} {'prec.':>6}"]
    for pct, modes in runs.items():
        off = modes.get("off")
        for mode, r in modes.items():
            p = r.prefetch or {}
            lines.append(
                f"{pct:>7g} {mode:>9} {r.tok_s:>7.2f} {_fmt(off and r.tok_s / off.tok_s, '6.2f'):>6} "
                f"{1e3 * r.stall_s_per_token:>7.1f} "
                f"{_fmt(off and r.stall_s_per_token and off.stall_s_per_token / r.stall_s_per_token, '8.2f'):>8} "
                f"{r.bytes_read_disk_per_token / MB:>7.1f} {r.wasted_bytes_per_token / MB:>7.1f} "
                f"{_fmt(p.get('recall_effective'), '6.2f'):>6} "
                f"{_fmt((p.get('route_ahead') or {}).get('precision'), '6.2f'):>6} {r.io_overlap:>7.2f}  "
                f"{','.join('on' if v else 'off' for v in (p.get('pay_check_verdicts') or [])) or '-'}")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speed(rows: list[Row], resident: EngineRun, path: Path) -> None:
    """Decode tok/s against the RAM budget: the engine, accelerate per page-cache mode, the resident reference."""
    plt = _pyplot()
    x = [r.budget_pct for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r.engine.tok_s for r in rows], "o-", label="engine (O_DIRECT below 100%)")
    for mode, label in (("bypass", "accelerate, page cache evicted"), ("allow", "accelerate, page cache allowed")):
        pts = [(r.budget_pct, r.peers[mode].tok_s) for r in rows if mode in r.peers]
        if pts:
            ax.plot(*zip(*pts), "s--", label=label)
    ax.axhline(resident.tok_s, color="grey", lw=0.8, ls=":", label="engine, every unit resident")
    ax.set(xlabel="RAM budget (% of model bytes)", ylabel="decode tok/s", yscale="log", title="decode speed")
    ax.invert_xaxis()
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bytes(rows: list[Row], path: Path) -> None:
    """MB read per decode token by tier, per budget: the engine's disk -> RAM (and RAM -> VRAM when there is a
    device tier) from its store counters; accelerate's disk tier (its offloaded parameters, reloaded at every
    forward) and what really came from storage (/proc/self/io) per page-cache mode."""
    plt = _pyplot()
    series = [("engine: disk -> RAM", [r.engine.bytes_read_disk_per_token for r in rows])]
    if any(r.engine.bytes_host_to_device_per_token for r in rows):
        series.append(("engine: RAM -> VRAM", [r.engine.bytes_host_to_device_per_token for r in rows]))
    if any(r.peers for r in rows):
        series.append(("accelerate: disk tier -> RAM", [max([p.bytes_on_disk for p in r.peers.values()], default=0)
                                                       for r in rows]))
    for mode in ("bypass", "allow"):
        if any(mode in r.peers for r in rows):
            series.append((f"accelerate ({mode}): from storage",
                           [(r.peers[mode].os_read_bytes_per_token or 0) if mode in r.peers else 0 for r in rows]))
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(series)
    for i, (label, ys) in enumerate(series):
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))], [y / MB for y in ys], width,
               label=label)
    ax.set_xticks(range(len(rows)), [f"{r.budget_pct:g}%" for r in rows])
    ax.set(xlabel="RAM budget (% of model bytes)", ylabel="MB per decode token", title="bytes read per token")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_paths(plot: str, json_path: str) -> tuple[Path, Path]:
    """--plot PREFIX (default: the JSON path without .json) -> PREFIX-tok_s.png, PREFIX-bytes.png."""
    prefix = Path(plot) if plot else Path(json_path).with_suffix("")
    prefix = prefix.with_suffix("") if prefix.suffix == ".png" else prefix
    return prefix.with_name(prefix.name + "-tok_s.png"), prefix.with_name(prefix.name + "-bytes.png")
