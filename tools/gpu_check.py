#!/usr/bin/env python3
"""One short script for a CUDA machine (< 5 minutes): the checks that need a GPU, as a table and JSON.

  python tools/gpu_check.py [--out DIR] [--skip-tests] [--layers 4]

1. the parity, store and budget tests on cuda (Engine.open picks cuda when it is available);
2. pinned host->device copy bandwidth (CUDA events);
3. GPUDirect Storage: kvikio reads of a file into device memory (when kvikio imports);
4. overlap of host->device copies on a side stream with matmuls on the compute stream;
5. the engine at a VRAM budget on a Qwen3-30B-A3B-shaped checkpoint (its real layer shape, fewer layers), with the
   VRAM budget scaled by the same layer ratio as 12 GiB is to the full 48-layer model.
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
from pathlib import Path

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
        compat = getattr(getattr(kvikio, "defaults", None), "compat_mode", lambda: "unknown")()
        return {"available": True, "GBps": n / seconds / 1e9, "bytes": n, "compat_mode": str(compat)}
    finally:
        os.unlink(path)


def copy_compute_overlap(nbytes: int = 256 << 20, n: int = 4096) -> dict:
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def compute():
        for _ in range(8):
            a @ a

    def copy():
        with torch.cuda.stream(side):
            dev.copy_(pinned, non_blocking=True)

    t_compute, t_copy = timed_cuda(compute, 3), timed_cuda(copy, 3)
    t_both = timed_cuda(lambda: (copy(), compute()), 3)
    hidden = (t_compute + t_copy - t_both) / min(t_compute, t_copy)
    return {"compute_s": t_compute, "copy_s": t_copy, "together_s": t_both, "overlap_fraction": max(0.0, hidden)}


def engine_bench(out: Path, layers: int) -> dict:
    """A Qwen3-30B-A3B-shaped checkpoint with `layers` layers, VRAM budget 12 GiB x layers / 48."""
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
    model_dir = out / "q30b-shape"
    if not (model_dir / "config.json").exists():
        config = transformers.AutoConfig.for_model(**cfg)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(model_dir, max_shard_size="2GB")
        del model
        torch.cuda.empty_cache()
    vram = int(12 * 2**30 * layers / 48)
    results = {}
    # ram=50%: experts stream from disk; expert prefetching off / always on (router lookahead and route ahead, which
    # should pay where compute is fast next to the link) / adaptive (the default)
    runs = [("100%", "adaptive", PrefetchConfig())] + [("50%", mode, config) for mode, config in (
        ("off", False), ("on", PrefetchConfig(adaptive=False)), ("adaptive", PrefetchConfig()))]
    for ram, mode, prefetch in runs:
        with Engine.open(model_dir, budget=Budget(vram=vram, ram=ram), max_context=512, prefetch=prefetch) as engine:
            engine.generate(list(range(40, 48)), max_new_tokens=8, ignore_eos=True)  # warm-up
            c = engine.generate(list(range(1, 33)), max_new_tokens=32, ignore_eos=True)
            prefetched = c.stats["prefetch"]
            results[f"vram={vram >> 20}MiB ram={ram} prefetch={mode}"] = {
                **{k: c.stats[k] for k in ("decode_tok_s", "prefill_tok_s", "hit_rate", "bytes_read_disk_per_token",
                                           "bytes_host_to_device", "io_wait_s", "expert_reads", "peak_bytes",
                                           "budget_bytes")},
                "route_ahead": prefetched.get("route_ahead"), "recall_effective": prefetched.get("recall_effective"),
                "pay_check_verdicts": prefetched.get("pay_check_verdicts")}
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench-out")))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    steps = [("h2d", h2d_bandwidth), ("gds", gds_read), ("overlap", copy_compute_overlap),
             ("engine", lambda: engine_bench(args.out, args.layers))]
    if not args.skip_tests:
        def tests():
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/test_parity.py",
                                   "tests/test_store.py", "tests/test_budgets.py", "tests/test_prefetch.py"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=240)
            return {"returncode": proc.returncode, "tail": proc.stdout.strip().splitlines()[-3:]}
        steps.insert(0, ("tests", tests))
    for name, fn in steps:
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # one failing check must not hide the others' figures
            report[name] = {"error": repr(e)}
        print(f"{name:<8} {time.perf_counter() - t:6.1f}s  {json.dumps(report[name])[:300]}")
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
