#!/usr/bin/env python3
"""Benchmark the engine against transformers + accelerate disk offload at the same RAM budgets.

For each budget (a % of the checkpoint's bytes) both systems decode the same greedy tokens after the same
prompt; the table gives decode tok/s, bytes read per token, hit rate, stall time and the engine's time per
token against a physical bound, max(resident compute time, bytes read and used / measured O_DIRECT bandwidth).
The resident compute time is measured right before and right after each budget's engine runs (their mean is the
bound's), not once: this VM's CPU speed drifts by up to ~15% over minutes (user CPU per token of the same work),
as much as the bound's margin, and one side of the engine's run alone would lean with the drift. Each budget runs
`--rounds` rounds (default 5), each between two resident runs; the table shows the median round against its
bound and the spread of all rounds, the JSON every run. (Single runs of the same work differ by up to ~18% on
this VM; at 25%, single rounds of one build in one session ranged 1.04-1.47 of the bound: five rounds.)

    python tools/bench.py                          # bench checkpoint (built if missing), budgets 100,50,25,10
    python tools/bench.py --quick --json out.json  # tiny checkpoint, budgets 100,25, 4 tokens (smoke run)
    python tools/bench.py --plot                   # also bench-tok_s.png and bench-bytes.png next to the JSON
    python tools/bench.py --budgets 25,10 --no-peer --prefetch off,on,adaptive   # prefetch compared, one run
    python tools/bench.py --peer accelerate,llama   # + llama.cpp at the same bit width (tools/bench_llama.py)
    python tools/bench.py --routing realistic       # the bench checkpoint with realistic routing (Zipf + locality)

Next to that bound each row shows the physical one (tools/bench_physical.py): max(active weight bytes per token /
measured memory read bandwidth, bytes read and used / O_DIRECT bandwidth), which does not lean on the engine's
own resident speed.

--prefetch MODES: the engine's expert prefetch, off / on (always) / adaptive (its pay check decides, the
default of Engine.open). The first mode is the engine of the main table; with several, every budget runs each
mode and a second table compares them with off (stall, tok/s, share of expert reads made ahead, route ahead's
precision, wasted reads, I/O overlap).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the engine next to this script, also when run from a snapshot of the repo

import psutil  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from offload_engine import Budget, Engine, PrefetchConfig  # noqa: E402
from offload_engine.probe import (MiB, Meter, machine_info, measure_cpu_matmul_flops,  # noqa: E402
                                  measure_direct_read_bandwidth, measure_memcpy_bandwidth)
from offload_engine.generate.decoder import FinishEvent  # noqa: E402
from offload_engine.modes import POLICIES  # noqa: E402
from tools.bench_accelerate import run_peer  # noqa: E402
from tools.bench_common import (EngineRun, PeerRun, Row, label, prompt_ids, reporting_interrupts,  # noqa: E402
                                settle_freed_memory, wait_for_quiet)
from tools.bench_physical import (active_bytes_hf, measure_memory_read_bandwidth, physical_bound,  # noqa: E402
                                  summary as physical_summary)
from tools.bench_report import plot_bytes, plot_paths, plot_speed, prefetch_table, table  # noqa: E402

PREFETCH_MODES = {"off": False, "on": PrefetchConfig(adaptive=False), "adaptive": PrefetchConfig()}
TARGETS_AT = 25  # the acceptance budget (%)


# ---- the engine ---------------------------------------------------------------------------------------------
def run_engine(model: Path, pct: float | None, prompt: list[int], warm: list[int], steps: int,
               progress: bool, quiet: float = 0.0, prefetch: str = "adaptive", context: int | None = None,
               policy: str = "lru-floor", ram: int | None = None, dtype: str | None = None) -> EngineRun:
    """One engine at one budget: an untimed warm-up request (another prompt, so kernels and the cache are
    warm but not primed with this sequence), then the measured one. Decode figures exclude the prefill.
    ram: a budget in bytes instead of `pct` of the model's bytes (pct is then only the run's label).
    dtype: the compute dtype (None: Engine.open's default)."""
    budget = Budget() if pct is None else Budget(ram=ram if ram is not None else f"{pct:g}%")
    direct = "auto" if pct is None or pct >= 100 else "on"
    start = time.perf_counter()
    options = {} if prefetch == "adaptive" else {"prefetch": PREFETCH_MODES[prefetch]}
    options.update({"dtype": dtype} if dtype is not None else {})
    engine = Engine.open(model, budget=budget, max_context=context or len(prompt) + steps + 8, direct_io=direct,
                         policy=policy, **options)
    open_s = time.perf_counter() - start
    try:
        engine.generate(warm, max_new_tokens=min(steps, 4) + 1, ignore_eos=True)
        wait_for_quiet(quiet)
        return _measured_request(engine, pct, prompt, steps, open_s, progress, prefetch)
    finally:
        rss = psutil.Process().memory_info().rss
        engine.close()
        del engine
        gc.collect()
        settle_freed_memory(rss)


def _measured_request(engine: Engine, pct: float | None, prompt: list[int], steps: int, open_s: float,
                      progress: bool, prefetch: str) -> EngineRun:
    meter, before, finish = Meter(), None, None
    bar = tqdm(total=steps, desc=f"engine {label(pct)}", unit="tok", leave=False, disable=not progress)
    for event in engine.stream(prompt, max_new_tokens=steps + 1, ignore_eos=True):
        if isinstance(event, FinishEvent):
            meter.stop()
            finish = event
        elif before is None:  # the prefill's token: decode starts here
            before = engine.snapshot()
            meter.start()
        else:
            bar.update()
    bar.close()
    after, stats = engine.snapshot(), finish.stats
    n = len(finish.token_ids) - 1
    tier = engine.compute_tier
    hits = after["hits"][tier] - before["hits"][tier]
    misses = after["misses"][tier] - before["misses"][tier]
    decode_s = stats["decode_s"]
    read = after["bytes_read_disk"] - before["bytes_read_disk"]
    wasted = after.get("prefetch_wasted", 0) - before.get("prefetch_wasted", 0)
    busy, stall = (after.get("read_busy_s", 0.0) - before.get("read_busy_s", 0.0),
                   after["io_wait_s"] - before["io_wait_s"])
    unit = engine.placement.sizes["expert"].slot_bytes if "expert" in engine.placement.sizes else 0
    return EngineRun(
        budget_pct=pct, tokens=list(finish.token_ids), decode_steps=n, decode_s=decode_s,
        s_per_token=decode_s / n, tok_s=n / decode_s,
        bytes_read_disk_per_token=read / n, needed_bytes_per_token=max(0, read - wasted * unit) / n,
        os_read_bytes_per_token=meter.per(n), hit_rate=hits / max(hits + misses, 1),
        stall_s_per_token=stall / n, cpu_util=meter.cpu_util,
        others_cpu=meter.others_cpu,
        peak_bytes=stats["peak_bytes"], budget_bytes=stats["budget_bytes"], direct_io=engine.store.direct_io,
        open_s=open_s, prefetch=stats.get("prefetch") or {},
        bytes_host_to_device_per_token=(after["bytes_host_to_device"] - before["bytes_host_to_device"]) / n,
        prefetch_mode=prefetch, wasted_bytes_per_token=wasted * unit / n,
        io_overlap=max(0.0, 1.0 - stall / busy) if busy > 0 else 1.0,
        read_bytes_per_busy_s=read / busy if busy > 0 and read else None)


# ---- machine and probe ------------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    import accelerate
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__}


def source_state() -> dict[str, Any]:
    """Which engine was measured: the commit and the files that differ from it, and a hash of the package's
    sources (the only identity of a snapshot copied out of the repository)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                                  timeout=10).stdout.rstrip("\n")  # not strip(): porcelain lines start " M"
        except (OSError, subprocess.SubprocessError):
            return ""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "offload_engine").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    if Path(git("rev-parse", "--show-toplevel") or "/nonexistent").resolve() != ROOT:  # a copied snapshot
        return {"root": str(ROOT), "commit": None, "package_sha256": digest.hexdigest(), "modified": None}
    return {"root": str(ROOT), "commit": git("rev-parse", "HEAD"), "package_sha256": digest.hexdigest(),
            "modified": [line[3:] for line in git("status", "--porcelain").splitlines()]}


def probe_disk(model: Path, unit_bytes: int, nbytes: int, repeats: int) -> list[dict]:
    """O_DIRECT read bandwidth on the largest shard: large sequential reads by one thread, and reads of the
    engine's unit size by as many threads as its reader pool (4)."""
    shard = max(model.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    unit_block = max(4096, -(-unit_bytes // 4096) * 4096)
    return [measure_direct_read_bandwidth(shard, nbytes, block, threads, repeats).to_dict()
            for block, threads in ((8 * MiB, 1), (unit_block, 4))]


def expert_unit_bytes(model: Path) -> int:
    from offload_engine.checkpoint.model import open_model

    ckpt = open_model(model)
    sizes = [layout.nbytes for key, layout in ckpt.layouts.items() if key.kind == "expert"]
    return max(sizes) if sizes else 8 * MiB


# ---- the run ------------------------------------------------------------------------------------------------
def ensure_model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from tools.make_checkpoint import make_checkpoint

    name = "quick-model" if args.quick else f"bench-model{'-bf16' if args.dtype == 'bfloat16' else ''}"
    realistic = args.routing == "realistic"
    out = Path(args.work_dir) / (name + ("-realistic" if realistic else ""))
    done = out / "config.json" if not realistic else out / "realistic_routing.json"
    if not done.is_file():
        make_checkpoint("qwen3_moe", "offload" if args.quick else "bench", out, dtype=args.dtype, force=True)
        if realistic:
            from tools.realistic_routing import apply

            apply(out)
    return out


def model_info(model: Path) -> dict[str, Any]:
    config = json.loads((model / "config.json").read_text())
    shards = sorted(model.glob("*.safetensors"))
    return {"path": str(model), "bytes": sum(p.stat().st_size for p in shards), "model_type": config.get("model_type"),
            "dtype": config.get("dtype") or config.get("torch_dtype"), "layers": config.get("num_hidden_layers"),
            "experts": config.get("num_experts") or config.get("num_local_experts"), "top_k": config.get("num_experts_per_tok"),
            "vocab": config.get("vocab_size")}


def disk_bandwidth(samples: list[dict]) -> float:
    """The bound's O_DIRECT bandwidth from probe_disk samples: per read pattern (one thread of 8 MiB blocks,
    four of the unit size) the median, then the faster pattern."""
    return max(statistics.median(d["bytes_per_s"] for d in samples if d["threads"] == t)
               for t in {d["threads"] for d in samples})


@dataclass
class BudgetRuns:
    """One budget's engine runs: `--rounds` rounds of every prefetch mode, each round between two resident runs
    (residents[i] before round i, residents[i + 1] after it), and O_DIRECT samples before and after them all."""
    rounds: list[dict[str, EngineRun]]
    residents: list[EngineRun]
    disk_around: tuple[list[dict], list[dict]]

    def median_round(self, mode: str, disk_bw: float) -> tuple[int, list[float]]:
        """The round whose `mode` run is the median against its bound (the upper one of an even count), and
        every round's ratio in order."""
        ratios = [run[mode].s_per_token / bound_s(run[mode], self.around(i), disk_bw)
                  for i, run in enumerate(self.rounds)]
        return sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2], ratios

    def around(self, i: int) -> tuple[float, float]:
        return self.residents[i].s_per_token, self.residents[i + 1].s_per_token


def bound_s(engine: EngineRun, around: tuple[float, float], disk_bw: float) -> float:
    """The physical bound per token: max(resident compute time, bytes read and used / O_DIRECT bandwidth)."""
    return max(statistics.mean(around), engine.needed_bytes_per_token / disk_bw)


def make_row(pct: float, runs: BudgetRuns, mode: str, peers: dict[str, PeerRun]) -> Row:
    """The bound uses the resident compute time and the disk bandwidth measured around this budget's engine
    runs: this VM's disk delivered 0.6-3.7 GB/s in phases of minutes, and its CPU drifts too. With several
    rounds the row is the median round: single runs of identical work differ by up to ~18% here."""
    before, after = runs.disk_around
    disk_bw = disk_bandwidth(before + after)
    i, ratios = runs.median_round(mode, disk_bw)
    engine, around = runs.rounds[i][mode], runs.around(i)
    match = {m: run.tokens == engine.tokens for m, run in peers.items()}
    return Row(pct, engine, peers, statistics.mean(around), around, disk_bw,
               (disk_bandwidth(before), disk_bandwidth(after)), bound_s(engine, around, disk_bw), ratios[i], match,
               ratios, i)


def targets(rows: list[Row]) -> dict[str, Any]:
    """The issue's acceptance figures at 25% of the model's bytes."""
    row = next((r for r in rows if r.budget_pct == TARGETS_AT), None)
    if row is None:
        return {}
    out = {"budget_pct": TARGETS_AT}
    for name, value, goal, better in (("engine_vs_peer_bypass", row.ratio("bypass"), 20.0, "higher"),
                                      ("engine_vs_peer_page_cache", row.ratio("allow"), 1.5, "higher"),
                                      ("engine_vs_physical_bound", row.engine_vs_bound, 1.25, "lower")):
        if value is not None:
            met = value >= goal if better == "higher" else value <= goal
            out[name] = {"value": value, "target": goal, "met": met}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Hugging Face folder (default: build the bench checkpoint in --work-dir)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of the built checkpoint")
    ap.add_argument("--routing", default="random", choices=("random", "realistic"),
                    help="the built checkpoint's routers: random (transformers' init: ~94%% LRU hits at 25%%) or "
                         "realistic (tools/realistic_routing.py: Zipf popularity + token locality, 70-85%%)")
    ap.add_argument("--budgets", default="100,50,25,10", help="RAM budgets, %% of the model's bytes")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps (after the prefill's token)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--context", type=int, default=None,
                    help="KV positions the engine reserves in its budget (default: prompt + tokens + 8)")
    ap.add_argument("--peer", nargs="?", const="accelerate", default="auto", metavar="PEERS",
                    help="comma-separated from accelerate (transformers + accelerate disk offload, per budget) and "
                         "llama (llama.cpp's llama-bench on the same checkpoint in BF16 / Q8_0 / Q4_K_M against "
                         "the engine's bf16 / ct-int8 / ct-int4, resident, same threads: tools/bench_llama.py); "
                         "bare --peer: accelerate; default: accelerate, plus llama where its build is cached "
                         "(python tools/llama_peer.py build) and not with --quick")
    ap.add_argument("--no-peer", dest="peer", action="store_const", const="", help="the engine only")
    ap.add_argument("--peer-page-cache", default="both", choices=("bypass", "allow", "both"))
    ap.add_argument("--work-dir", default="bench-out", help="built checkpoints and the peer's offload folders")
    ap.add_argument("--json", help="results file (default: WORK_DIR/bench.json)")
    ap.add_argument("--plot", nargs="?", const="", default=None, metavar="PREFIX",
                    help="PNGs PREFIX-tok_s.png (speed against budget) and PREFIX-bytes.png (bytes read per token "
                         "by tier); default PREFIX: the JSON path without .json")
    ap.add_argument("--probe-mib", type=int, default=512, help="MiB read per O_DIRECT bandwidth sample")
    ap.add_argument("--prefetch", default="adaptive", metavar="MODES",
                    help="comma-separated engine prefetch modes from off,on,adaptive (default: adaptive, as "
                         "Engine.open); the first is the main table's engine, all are compared per budget")
    ap.add_argument("--policy", default="lru-floor", choices=POLICIES,
                    help="the engine's expert cache eviction policy (default: Engine.open's)")
    ap.add_argument("--rounds", type=int, default=None, metavar="N",
                    help="engine runs per budget and prefetch mode, each between two resident runs; the table "
                         "shows the median round and the spread (default 5; --quick 1)")
    ap.add_argument("--torch-threads", type=int, default=0, metavar="N",
                    help="torch intra-op threads for both systems (default: torch's own choice)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each measured decode wait up to S seconds for other processes to go idle")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny checkpoint, budgets 100,25, 4 tokens")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    if args.quick:
        args.budgets, args.tokens, args.prompt_len, args.probe_mib = "100,25", 4, 4, 8
    args.rounds = args.rounds if args.rounds is not None else 1 if args.quick else 5
    peers = resolve_peers(args.peer, args.quick)
    if peers is None:
        ap.error(f"--peer: expected names from accelerate,llama, got {args.peer!r}")
    args.peer, args.llama = "accelerate" in peers, "llama" in peers
    if args.rounds < 1:
        ap.error(f"--rounds: expected at least 1, got {args.rounds}")
    args.json = args.json or str(Path(args.work_dir) / "bench.json")
    args.prefetch = args.prefetch.split(",")
    unknown = [m for m in args.prefetch if m not in PREFETCH_MODES]
    if unknown or not args.prefetch:
        ap.error(f"--prefetch: expected modes from {','.join(PREFETCH_MODES)}, got {','.join(unknown) or 'none'}")
    return args


def resolve_peers(spec: str, quick: bool) -> set[str] | None:
    """--peer's value -> the peers to run (None: an unknown name)."""
    if spec == "auto":
        from tools.llama_peer import built

        return {"accelerate"} | ({"llama"} if built() is not None and not quick else set())
    names = {n for n in spec.split(",") if n}
    return names if names <= {"accelerate", "llama"} else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    started, machine = time.time(), machine_info()
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    modes = ["bypass", "allow"] if args.peer_page_cache == "both" else [args.peer_page_cache]
    model = ensure_model(args)
    info = model_info(model)
    prompt, warm = prompt_ids(args.prompt_len, info["vocab"]), prompt_ids(args.prompt_len, info["vocab"], 1)

    repeats = 1 if args.quick else 3
    unit = expert_unit_bytes(model)
    disk = probe_disk(model, unit, args.probe_mib * MiB, repeats)
    mem_bytes = (256 if args.quick else 1024) * MiB
    mem = [measure_memory_read_bandwidth(mem_bytes)]

    def engine_run(pct: float | None, mode: str) -> EngineRun:
        return run_engine(model, pct, prompt, warm, args.tokens, args.progress, args.wait_quiet, mode, args.context,
                          args.policy)

    rows, by_mode, all_runs, resident = [], {}, {}, None
    for pct in tqdm(budgets, desc="budgets", unit="budget", disable=not args.progress):
        disk_before = probe_disk(model, unit, args.probe_mib * MiB, 1)
        residents, rounds = [engine_run(None, args.prefetch[0])], []
        resident = resident or residents[0]  # the first: the table's and the plot's reference
        for _ in range(args.rounds):
            rounds.append({mode: engine_run(pct, mode) for mode in args.prefetch})
            residents.append(engine_run(None, args.prefetch[0]))
        runs = BudgetRuns(rounds, residents, (disk_before, probe_disk(model, unit, args.probe_mib * MiB, 1)))
        peers = run_peer(model, pct, int(info["bytes"] * pct / 100), modes, prompt, args.tokens,
                         Path(args.work_dir), args.progress, args.wait_quiet) if args.peer else {}
        rows.append(make_row(pct, runs, args.prefetch[0], peers))
        all_runs[pct] = runs
        by_mode[pct] = rounds[rows[-1].median_round]  # the prefetch table compares the modes of that round
    disk += probe_disk(model, unit, args.probe_mib * MiB, repeats)  # the disk drifts: sample it again at the end
    mem.append(measure_memory_read_bandwidth(mem_bytes))
    mem_bw = max(mem, key=lambda m: m.bytes_per_s)
    active = active_bytes_hf(model)
    for r in rows:
        r.physical = physical_bound(active, mem_bw.bytes_per_s, r.engine.s_per_token, r.engine.needed_bytes_per_token,
                                    r.disk_bw).to_dict()
    physical = {**physical_summary(active, mem_bw), "memory_read_samples": [asdict(m) for m in mem]}
    physical["resident_engine_vs_physical"] = resident.s_per_token / physical["resident_bound_s_per_token"]
    llama = None
    if args.llama:  # resident, after the budgets: its checkpoints and GGUFs are built on first use
        from tools.bench_llama import LlamaSettings, llama_table, run_llama_section

        llama = run_llama_section(LlamaSettings.of(args), prompt, warm, mem_bw.bytes_per_s, run_engine)

    print(table(rows, resident, physical))
    if llama:
        print(llama_table(llama))
    if len(args.prefetch) > 1:
        print(prefetch_table(by_mode))
    result = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)), "duration_s": time.time() - started,
        "machine": {**machine, "loadavg_end": os.getloadavg()}, "versions": versions(),
        "engine_source": source_state(), "model": info,
        "settings": {"budgets": budgets, "tokens": args.tokens, "prompt_len": args.prompt_len, "peer": args.peer,
                     "context": args.context, "llama_peer": args.llama, "routing": args.routing,
                     "peer_page_cache": modes, "prompt": prompt,
                     "torch_threads": torch.get_num_threads(), "wait_quiet_s": args.wait_quiet,
                     "settles_freed_memory": reporting_interrupts() is not None,
                     "prefetch_modes": args.prefetch, "rounds": args.rounds, "policy": args.policy},
        "probe": {"disk": disk, "disk_bandwidth_start_end": disk_bandwidth(disk), "expert_unit_bytes": unit,
                  "memcpy": measure_memcpy_bandwidth().to_dict(), "cpu_matmul": measure_cpu_matmul_flops().to_dict()},
        "physical": physical, "llama_peer": llama,
        "resident": asdict(resident), "rows": [asdict(r) for r in rows], "targets": targets(rows),
        "rounds": {f"{pct:g}": {"resident_s_per_token": [r.s_per_token for r in runs.residents],
                                "engine_s_per_token": {m: [rnd[m].s_per_token for rnd in runs.rounds]
                                                       for m in args.prefetch}}
                   for pct, runs in all_runs.items()},
        "prefetch_compare": {f"{pct:g}": {m: asdict(r) for m, r in modes.items()} for pct, modes in by_mode.items()}
        if len(args.prefetch) > 1 else {},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot is not None:
        speed, nbytes = plot_paths(args.plot, args.json)
        speed.parent.mkdir(parents=True, exist_ok=True)
        plot_speed(rows, resident, speed)
        plot_bytes(rows, nbytes)
        print(f"plots: {speed} {nbytes}")
    for name, t in result["targets"].items():
        if isinstance(t, dict):
            print(f"target {name}: {t['value']:.2f} (target {t['target']}) {'met' if t['met'] else 'MISSED'}")
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
