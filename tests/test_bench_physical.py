"""The bench's physical bound (tools/bench_physical.py), its realistic-routing preset (tools/realistic_routing.py)
and the llama.cpp peer (tools/llama_peer.py, tools/bench_llama.py). The llama.cpp smoke runs only where its build
is cached (python tools/llama_peer.py build); nothing here builds it. No timing assertions beyond "positive"."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import llama_peer  # noqa: E402
from tests.llama_cpp_build import require_llama_cpp  # noqa: E402
from tools.bench_physical import (active_bytes_gguf, active_bytes_hf, measure_memory_read_bandwidth,  # noqa: E402
                                  physical_bound)


@pytest.fixture(scope="module")
def quick_bf16(tmp_path_factory) -> Path:
    from tools.make_checkpoint import make_checkpoint

    return make_checkpoint("qwen3_moe", "offload", tmp_path_factory.mktemp("ck") / "m", dtype="bfloat16")


def test_bench_reports_the_physical_bound(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--no-progress", "--no-peer",
                           "--work-dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = next(line for line in proc.stdout.splitlines() if "/bound" in line)
    assert "phys" in header and "/phys" in header
    assert "MB active per token" in proc.stdout
    result = json.loads(out.read_text())
    phys = result["physical"]
    active = phys["active_bytes"]
    assert 0 < active["per_token"] < active["total"] and active["experts"] > 0 and active["embedding_row"] > 0
    assert phys["memory_read"]["bytes_per_s"] > 1e8 and phys["resident_bound_s_per_token"] > 0
    assert phys["resident_engine_vs_physical"] > 0 and result["llama_peer"] is None
    assert result["settings"]["routing"] == "random" and result["settings"]["llama_peer"] is False
    for row in result["rows"]:
        p = row["physical"]
        assert p["s_per_token"] == max(p["resident_s"], p["disk_s"]) > 0
        assert p["measured_s"] == row["engine"]["s_per_token"]
        assert p["measured_vs_bound"] == pytest.approx(p["measured_s"] / p["s_per_token"])
    below = result["rows"][1]
    assert below["budget_pct"] == 25 and below["physical"]["disk_s"] > 0  # it read: missed bytes / O_DIRECT


def test_active_bytes_count_top_k_experts_and_one_embedding_row(quick_bf16):
    config = json.loads((quick_bf16 / "config.json").read_text())
    a = active_bytes_hf(quick_bf16)
    share = config["num_experts_per_tok"] / config["num_local_experts"]
    assert a.experts == pytest.approx(share * (a.total - a.dense - a.embedding_row * config["vocab_size"]), rel=1e-6)
    assert a.embedding_row == config["hidden_size"] * 2  # bf16
    assert a.per_token == a.experts + a.dense + a.embedding_row
    b = physical_bound(a, mem_bw=1e9, measured_s=0.01, missed_bytes=4e6, disk_bw=1e9)
    assert b.resident_s == pytest.approx(a.per_token / 1e9) and b.disk_s == pytest.approx(4e-3)
    assert b.s_per_token == max(b.resident_s, b.disk_s) and b.measured_vs_bound == pytest.approx(0.01 / b.s_per_token)
    mem = measure_memory_read_bandwidth(16 << 20, repeats=2)
    assert mem.bytes_per_s == max(mem.samples) > 0 and len(mem.samples) == 2


def test_realistic_routing_rewrites_values_not_shapes(tmp_path):
    """The preset changes only embedding, head and router values; greedy decoding walks its token cycle (no
    repetition), the engine routes as the design says (tools/realistic_routing.simulate_routing, which the preset
    was tuned on), and an LRU cache of a quarter of the experts hits within the published range."""
    from offload_engine import Engine
    from tools.make_checkpoint import make_checkpoint, safetensors_sizes
    from tools.realistic_routing import RoutingPreset, apply, routing_weights, simulate_routing
    from tools.trace_experts import acquisitions, routing_trace, simulate

    model = make_checkpoint("qwen3_moe", "offload", tmp_path / "m")
    before = safetensors_sizes(model)
    apply(model)
    assert safetensors_sizes(model) == before and (model / "realistic_routing.json").is_file()
    config = json.loads((model / "config.json").read_text())
    shape = (config["vocab_size"], config["hidden_size"], config["num_local_experts"])
    layers, top_k = list(range(config["num_hidden_layers"])), config["num_experts_per_tok"]
    _, _, _, order = routing_weights(*shape, layers, RoutingPreset())
    nxt = torch.empty(len(order), dtype=torch.long)
    nxt[order] = order.roll(-1)
    prompt = [5, 77, 300, 12]
    with Engine.open(model, max_context=64) as engine:
        tokens = engine.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids
    seq = [12, *tokens]
    assert all(int(nxt[a]) == b for a, b in zip(seq, seq[1:])) and len(set(tokens)) == 16
    trace = routing_trace(model, [prompt], 32, 64)
    decode = [(layer, sorted(t[0])) for layer, t in trace["steps"] if len(t) == 1]
    walk = [int(nxt[12])]  # the first decode step feeds the prefill's token
    for _ in range(len(decode) // len(layers) - 1):
        walk.append(int(nxt[walk[-1]]))
    design = [(layer, sorted(t[0])) for layer, t in simulate_routing(*shape, top_k, layers, RoutingPreset(), walk)]
    same = sum(a == b for a, b in zip(decode, design)) / len(decode)
    assert same > 0.9, same
    hits = simulate(acquisitions(trace), len(layers) * shape[2] // 4, "lru", len(layers), top_k)
    assert 0.6 < hits < 0.9, hits


def test_llama_bench_json_is_parsed():
    text = json.dumps([{"n_prompt": 0, "n_gen": 32, "avg_ts": 120.5, "stddev_ts": 2.0, "samples_ts": [118.5, 122.5],
                        "model_type": "qwen3moe ?B BF16", "model_size": 1234, "n_threads": 2,
                        "build_commit": "abc"}])
    r = llama_peer.parse_bench_json(text, "m.gguf")
    assert (r.tok_s, r.threads, r.n_gen, r.model_bytes, r.build_commit) == (120.5, 2, 32, 1234, "abc")
    with pytest.raises(llama_peer.LlamaPeerError, match="no tg test"):
        llama_peer.parse_bench_json(json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 1.0}]))
    with pytest.raises(llama_peer.LlamaPeerError, match="no JSON"):
        llama_peer.parse_bench_json("error: failed to load model")


def test_peer_option():
    from tools.bench import parse_args, resolve_peers

    assert resolve_peers("accelerate,llama", False) == {"accelerate", "llama"}
    assert resolve_peers("auto", True) == {"accelerate"}  # --quick never runs the llama peer by default
    assert resolve_peers("auto", False) == {"accelerate"} | ({"llama"} if llama_peer.built() else set())
    assert resolve_peers("", False) == set() and resolve_peers("vllm", False) is None
    a = parse_args(["--no-peer"])
    assert (a.peer, a.llama) == (False, False)
    a = parse_args(["--peer", "llama"])
    assert (a.peer, a.llama) == (False, True)
    a = parse_args(["--peer"])
    assert (a.peer, a.llama) == (True, False)


def test_llama_peer_smoke(quick_bf16, tmp_path):
    """The tiny checkpoint through llama.cpp's converter, llama-quantize and llama-bench (a few seconds)."""
    require_llama_cpp()
    gguf = llama_peer.convert(quick_bf16, tmp_path / "m-BF16.gguf", "bf16")
    q8 = llama_peer.quantize(gguf, "Q8_0")
    assert q8.name == "m-Q8_0.gguf" and 0 < q8.stat().st_size < gguf.stat().st_size
    config = json.loads((quick_bf16 / "config.json").read_text())
    hf, g = active_bytes_hf(quick_bf16), active_bytes_gguf(gguf, config["num_experts_per_tok"],
                                                           config["num_local_experts"])
    assert g.experts == hf.experts and abs(g.per_token - hf.per_token) < 0.1 * hf.per_token  # the same model
    r = llama_peer.run_bench(q8, threads=1, n_gen=4, repetitions=1)
    assert r.tok_s > 0 and r.n_gen == 4 and r.threads == 1 and "Q8_0" in r.model_type


def test_decode_profile_splits_a_token_into_native_ops_and_the_rest(quick_bf16, tmp_path):
    """tools/decode_profile.py: per-token wall time of each native kernel (where the CPU has them) and the
    prefill rate, as a table and JSON. (Both are differences of two requests: over 6 tokens noise may put the
    native sum above the token's time, so only their signs are checked.)"""
    from tools import decode_profile

    out = tmp_path / "p.json"
    assert decode_profile.main(["--model", str(quick_bf16), "--tokens", "6", "--prompt-len", "24",
                                "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["prefill_tokens"] == 24
    assert r["native_ms_per_token"] >= 0 and r["ms_per_token"] > 0
    if r["isa"] is not None:  # bf16 on the engine's kernels: every layer in one call (resident: the decode plan),
        # or a layer's experts in one (moe_row, or experts where the native kernels were measured slower for the
        # layer's shapes and only some ops take them)
        assert r["dtype"] == "bfloat16" and {"DecodePlan.run", "moe_row", "experts"} & set(r["native_ops"])
        assert r["decode_plan"] == ("DecodePlan.run" in r["native_ops"])
