#!/usr/bin/env python3
"""One short script for a CUDA machine (< 5 minutes): the checks that need a GPU, as a table and JSON.

  python tools/gpu_check.py [--out DIR] [--skip-tests] [--layers 4]

1. the CUDA tests (tests/test_cuda.py: VRAM budgets with and without GPUDirect bitwise equal to resident, the CUDA
   allocator against the ledger, read faults on the host-bounce path) and the parity and budget tests on cuda;
2. pinned host->device copy bandwidth (CUDA events);
3. GPUDirect Storage: kvikio reads of a file into device memory (when kvikio imports);
4. overlap of host->device copies on a side stream with matmuls on the compute stream;
5. the engine at a VRAM budget on a Qwen3-30B-A3B-shaped checkpoint (its real layer shape, fewer layers), with the
   per-layer part of 12 GiB scaled by layers / 48, at several RAM budgets, GPUDirect on and off, host compute off,
   auto and on; each run's tokens against the first's (host compute may differ by bf16 rounding: CPU vs GPU);
6. (`--int4`) the full-depth Qwen3-30B-A3B shape in compressed-tensors int4 group 32 (about 16 GB, written on the
   GPU by tools/synthetic_quant.py: the 61 GB bf16 copy would not fit the machine's 64 GiB disk) at 12 GiB VRAM
   and 32 GiB RAM, decode tok/s next to the planner's prediction for the same folder and budgets (--probe).
7. pipeline parallelism's single-rank path: `torchrun --nproc-per-node 1 ... run` (NCCL, world_size 1) against the
   plain engine's tokens (the multi-GPU NCCL path needs two GPUs and is not measured here);
CI never runs this; it is run by hand when a GPU machine is lent (see README).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed_cuda(fn, repeat: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeat


def h2d_bandwidth(nbytes: int = 512 << 20) -> dict:
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return {"pinned_GBps": nbytes / timed_cuda(lambda: dev.copy_(pinned, non_blocking=True)) / 1e9,
            "pageable_GBps": nbytes / timed_cuda(lambda: dev.copy_(pageable)) / 1e9}


def gds_read(nbytes: int = 512 << 20) -> dict:
    try:
        import kvikio
    except Exception as e:  # not installed: pip install .[gds]
        return {"available": False, "reason": repr(e)}
    with tempfile.NamedTemporaryFile(dir=ROOT, delete=False) as f:
        f.write(os.urandom(1 << 20) * (nbytes >> 20))
        path = f.name
    try:
        os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t = time.perf_counter()
        with kvikio.CuFile(path, "r") as cf:
            n = cf.pread(dev, nbytes, 0).get()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        try:  # a submodule kvikio's __init__ leaves unimported; >= 25: defaults.get(name), older: compat_mode()
            import kvikio.defaults as defaults
            compat = defaults.get("compat_mode") if hasattr(defaults, "get") else defaults.compat_mode()
            compat = f"{compat} (POSIX preferred: {defaults.is_compat_mode_preferred()})" \
                if hasattr(defaults, "is_compat_mode_preferred") else compat
        except Exception as e:
            compat = f"unknown ({e!r})"
        return {"available": True, "GBps": n / seconds / 1e9, "bytes": n, "compat_mode": str(compat)}
    finally:
        os.unlink(path)


def copy_compute_overlap(nbytes: int = 256 << 20, n: int = 4096) -> dict:
    """Host->device copies on a side stream against matmuls on the compute stream. The timing events sit on the
    compute stream, so each timed step ends with it waiting for the side stream (else the copy goes untimed)."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def compute():
        for _ in range(8):
            a @ a

    def copy():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dev.copy_(pinned, non_blocking=True)

    def copy_timed():
        copy()
        main.wait_stream(side)

    def both():
        copy()
        compute()
        main.wait_stream(side)

    t_compute, t_copy, t_both = timed_cuda(compute, 3), timed_cuda(copy_timed, 3), timed_cuda(both, 3)
    hidden = (t_compute + t_copy - t_both) / min(t_compute, t_copy)
    return {"compute_s": t_compute, "copy_s": t_copy, "together_s": t_both,
            "overlap_fraction": min(1.0, max(0.0, hidden))}


def engine_bench(scratch: Path, layers: int, device: str = "cuda") -> dict:
    """A Qwen3-30B-A3B-shaped checkpoint with `layers` layers. The VRAM budget is 12 GiB with the per-layer part
    scaled by layers / 48: the output head (vocab x hidden, held whole on the device) does not shrink with the
    layer count, so scaling all 12 GiB would leave the expert cache a far smaller share than the full model gets."""
    import transformers

    from offload_engine import Budget, Engine, PrefetchConfig

    cfg = json.loads((ROOT / "configs/models/Qwen3-30B-A3B.json").read_text()) \
        if (ROOT / "configs/models/Qwen3-30B-A3B.json").exists() else {
            "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "vocab_size": 151936, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0}
    cfg.pop("architectures", None)
    cfg.update(num_hidden_layers=layers, torch_dtype="bfloat16")
    model_dir = scratch / f"q30b-shape-{layers}"
    if not (model_dir / "config.json").exists():
        config = transformers.AutoConfig.for_model(**cfg)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(model_dir, max_shard_size="2GB")
        del model
        torch.cuda.empty_cache()
    head = cfg["vocab_size"] * cfg["hidden_size"] * 2
    vram = int(head + (12 * 2**30 - head) * layers / 48)
    results = {"vram_bytes": vram}
    # ram=100%: every expert cached in pinned RAM; ram=50%: experts also stream from disk, with expert prefetching
    # off / always on (router lookahead and route ahead, which should pay where compute is fast next to the link)
    # / adaptive (the default), and with GPUDirect off; ram=15%: the host holds little more than staging, so the
    # misses GPUDirect can take go NVMe -> VRAM. Every run's tokens must equal the first one's (lossless).
    # host compute: the experts RAM holds computed by the CPU, by the cost rule (auto) and always (on)
    adaptive = PrefetchConfig()
    runs = [("100%", "adaptive", adaptive, "auto", "off")] + [("50%", mode, config, "auto", "off") for mode, config in (
        ("off", False), ("on", PrefetchConfig(adaptive=False)), ("adaptive", adaptive))] + [
        ("50%", "adaptive", adaptive, "off", "off"), ("15%", "adaptive", adaptive, "auto", "off"),
        ("50%", "adaptive", adaptive, "auto", "auto"), ("50%", "adaptive", adaptive, "auto", "on")]
    runs.append(runs[0])  # the first run again, last: the machine's drift across the runs, apart from the configs
    reference = None
    for i, (ram, mode, prefetch, gds, host_compute) in enumerate(runs):
        name = f"ram={ram} prefetch={mode} gds={gds} host={host_compute}" + (" again" if i == len(runs) - 1 else "")
        os.environ["OFFLOAD_ENGINE_GDS"] = gds
        rss_before = psutil.Process().memory_info().rss
        try:
            with Engine.open(model_dir, budget=Budget(vram=vram, ram=ram), device=device, dtype="bfloat16",
                             max_context=512, prefetch=prefetch, host_compute=host_compute) as engine:
                engine.generate(list(range(40, 48)), max_new_tokens=8, ignore_eos=True)  # warm-up
                cpu_before = sum(psutil.Process().cpu_times()[:2])
                c = engine.generate(list(range(1, 33)), max_new_tokens=32, ignore_eos=True)
                cpu_s = sum(psutil.Process().cpu_times()[:2]) - cpu_before  # all threads: user + system
                used_gds = engine.store.gds is not None
                # the process's growth against the host budget: pinned pools must be the bytes charged
                rss_growth = psutil.Process().memory_info().rss - rss_before
        except Exception as e:  # one budget refused must not hide the other runs
            results[name] = {"error": repr(e)}
            continue
        finally:
            os.environ.pop("OFFLOAD_ENGINE_GDS", None)
        reference = reference or c.token_ids
        prefetched = c.stats["prefetch"]
        results[name] = {
            **{k: c.stats[k] for k in ("decode_tok_s", "prefill_tok_s", "hit_rate", "bytes_read_disk_per_token",
                                       "bytes_host_to_device", "io_wait_s", "expert_reads", "hits", "misses",
                                       "host_computed", "host_compute",
                                       "peak_bytes", "budget_bytes")},
            "gds_reader": used_gds, "tokens_equal_first_run": c.token_ids == reference, "rss_growth": rss_growth,
            "cpu_s": cpu_s, "wall_s": c.stats["prefill_s"] + c.stats["decode_s"],
            "route_ahead": prefetched.get("route_ahead"), "recall_effective": prefetched.get("recall_effective"),
            "pay_check_verdicts": prefetched.get("pay_check_verdicts")}
    return results


def int4_bench(scratch: Path, device: str = "cuda") -> dict:
    """The mission's 12 GB case on a real-size int4 model: measured decode against the planner's prediction."""
    from offload_engine import Budget, Engine
    from tools.synthetic_quant import write_synthetic
    from tools.quant_writers import QuantOptions

    model_dir = scratch / "q30b-a3b-ct-int4"
    written = {}
    if not (model_dir / "config.json").exists():
        config = json.loads((ROOT / "configs/models/Qwen3-30B-A3B.json").read_text())
        written = write_synthetic(config, model_dir, "ct-int4", QuantOptions(group_size=32), device=device)
    vram, ram = "12GiB", "32GiB"
    plan = subprocess.run([sys.executable, "-m", "offload_engine.cli", "plan", "--model", str(model_dir), "--vram",
                           vram, "--ram", ram, "--context", "512", "--probe", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    predicted = json.loads(plan.stdout)["predicted_tok_s"] if plan.returncode == 0 else {"error": plan.stderr[-500:]}
    with Engine.open(model_dir, budget=Budget(vram=vram, ram=ram), device=device, max_context=512) as engine:
        engine.generate(list(range(40, 48)), max_new_tokens=8, ignore_eos=True)  # warm-up
        c = engine.generate(list(range(1, 33)), max_new_tokens=32, ignore_eos=True)
    return {"written": written, "predicted_tok_s": predicted,
            **{k: c.stats[k] for k in ("decode_tok_s", "prefill_tok_s", "hit_rate", "bytes_read_disk_per_token",
                                       "bytes_host_to_device", "peak_bytes", "budget_bytes")}}


def single_rank(scratch: Path, device: str = "cuda") -> dict:
    """Pipeline parallelism's single-rank path under torchrun (NCCL on a GPU, gloo on a CPU): `world_size` 1, the
    same tokens as the plain engine. The multi-GPU path (NCCL send/recv between ranks) needs two GPUs."""
    from tools.make_checkpoint import make_checkpoint

    model_dir = scratch / "dist-qwen3_moe-tiny"
    if not (model_dir / "config.json").exists():
        make_checkpoint("qwen3_moe", "tiny", model_dir, force=True)
    run = ["run", "--model", str(model_dir), "--prompt", "def f(x):", "--max-new-tokens", "8", "--json", "--quiet",
           "--device", device]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                "offload_engine.cli"]
    out = {}
    for name, command in (("plain", [sys.executable, "-m", "offload_engine.cli"]), ("torchrun", torchrun)):
        proc = subprocess.run(command + run, cwd=ROOT, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            return {name: {"error": proc.stderr[-1500:]}}
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    stats = out["torchrun"]["stats"]
    return {"world_size": stats.get("world_size"), "ranks": stats.get("ranks"),
            "tokens_equal": out["torchrun"]["token_ids"] == out["plain"]["token_ids"],
            "decode_tok_s": {k: v["stats"]["decode_tok_s"] for k, v in out.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench-out")))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the generated checkpoint is written (kept between runs; not under --out)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--engine-only", action="store_true", help="only the engine bench (also runs on cpu: a dry run)")
    ap.add_argument("--int4", action="store_true", help="also the full-depth 30B-A3B int4 run (writes ~16 GB)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.engine_only:
        print("gpu_check: CUDA is not available on this machine", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if cuda else "cpu"
    report: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    steps = [("engine", lambda: engine_bench(args.scratch, args.layers, device)),
             ("1-rank", lambda: single_rank(args.scratch, device))]
    if args.int4:
        steps.append(("int4", lambda: int4_bench(args.scratch, device)))
    if not args.engine_only:
        steps[:0] = [("h2d", h2d_bandwidth), ("gds", gds_read), ("overlap", copy_compute_overlap)]
    if not args.skip_tests and not args.engine_only:
        def tests():
            # every failure's one-line reason, not just the first (a device run is too scarce to rerun per failure)
            # engines opened without a device run on cuda here (the suite's own default is cpu: tests/conftest.py);
            # the CPU-tier budget tests (a ram-only budget bounds the compute tier) are left to CI
            env = {**os.environ, "OFFLOAD_ENGINE_DEVICE": "cuda"}
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
                                   "tests/test_cuda.py", "tests/test_parity.py", "tests/test_budgets.py",
                                   "tests/test_store.py::test_three_tiers_and_policies_match_resident",
                                   "-k", "not process_memory"], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=240)
            (args.out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
            return {"returncode": proc.returncode, "tail": proc.stdout.strip().splitlines()[-25:]}
        steps.insert(0, ("tests", tests))
    for name, fn in steps:
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # one failing check must not hide the others' figures
            report[name] = {"error": repr(e)}
            traceback.print_exc()
        print(f"{name:<8} {time.perf_counter() - t:6.1f}s  {json.dumps(report[name])[:300]}")
    engine = report.get("engine", {})
    if engine and "error" not in engine:
        print(f"\n{'engine run (VRAM ' + str(engine['vram_bytes'] >> 20) + ' MiB)':<50} {'tok/s':>7} {'hit':>5} "
              f"{'MB disk/tok':>11} {'GB h2d':>7} {'on CPU':>6} {'wait s':>7} {'gds':>5} {'same tokens':>11} "
              f"{'RSS+ / host budget':>18} {'CPU/wall':>8}")
        for name, row in engine.items():
            if not isinstance(row, dict):
                continue
            if "error" in row:
                print(f"{name:<50} {row['error'][:70]}")
                continue
            print(f"{name:<50} {row['decode_tok_s']:7.1f} {row['hit_rate']:5.2f} "
                  f"{row['bytes_read_disk_per_token'] / 1e6:11.1f} {row['bytes_host_to_device'] / 1e9:7.2f} "
                  f"{row['host_computed']:6d} {row['io_wait_s']:7.3f} {str(row['gds_reader']):>5} "
                  f"{str(row['tokens_equal_first_run']):>11} "
                  f"{row['rss_growth'] / 2**30:8.2f}/{row['budget_bytes']['host'] / 2**30:.2f} GiB"
                  f" {row['cpu_s'] / row['wall_s']:8.2f}")
        for name, row in engine.items():  # auto's rule, from the rates it measured at open
            rule = row.get("host_compute", {}) if isinstance(row, dict) else {}
            if "host_expert_us" in rule:
                print(f"{name}: one expert, one token: CPU {rule['host_expert_us']:.0f} us vs copy + GPU "
                      f"{rule['copied_expert_us']:.0f} us (CPU {rule['cpu_gbps']:.1f} GB/s, "
                      f"H2D {rule['h2d_gbps']:.1f} GB/s, GPU {rule['gpu_gbps']:.0f} GB/s, CPU op "
                      f"{rule['cpu_op_us']:.1f} us, GPU op {rule['gpu_op_us']:.1f} us)")
            if rule.get("observed_host_expert_us"):  # what auto's rule weighs now, from the engine's own runs
                print(f"{name}: observed (running average) {rule['observed_host_expert_us']:.0f} us")
            if rule.get("measured_expert_us"):
                print(f"{name}: experts computed on the host took {rule['measured_expert_us']:.0f} us each")
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
