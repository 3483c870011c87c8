"""tools/bench_size.py at CI size: the real-size bench's path (the 30B-A3B widths: hidden 2048, experts of 768, with
two layers, eight experts and a short vocabulary), both files written by tools/synthetic_gguf.py, every row run.
A smoke test of the bench's plumbing: the figures are the bench's (docs/PERF.md), never asserted here."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.llama_cpp_build import require_llama_cpp
from tools import bench_size, synthetic_gguf

ROOT = Path(__file__).resolve().parents[1]
CI_SIZE = {**json.loads((ROOT / "configs/models/Qwen3-30B-A3B.json").read_text()),
           "num_hidden_layers": 2, "num_experts": 8, "vocab_size": 4096}


def test_the_bench_runs_every_row_at_ci_size(tmp_path):
    require_llama_cpp()
    files = {}
    for gtype in ("Q4_0", "Q8_0"):
        files[gtype] = tmp_path / f"ci-{gtype}.gguf"
        synthetic_gguf.write_synthetic_gguf(CI_SIZE, files[gtype], gtype)
    out = tmp_path / "bench-size.json"
    assert bench_size.main(["--gguf4", str(files["Q4_0"]), "--gguf8", str(files["Q8_0"]), "--budgets", "50%",
                            "--tokens", "4", "--prompt", "8", "--threads", "1", "--repetitions", "1",
                            "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert len(rows) == 4 and not [r for r in rows.values() if r["extra"].get("error")], rows
    for r in rows.values():
        assert r["tok_s"] > 0 and r["bound_s"] > 0 and r["disk_bytes_per_token"] is not None
    engine = [r for r in rows.values() if r["who"] == "engine"]
    assert all(r["open_s"] > 0 and r["ttft_s"] >= r["open_s"] and r["peak_rss"] > 0 for r in engine)
    assert all(r["predicted_tok_s"] for r in engine)
    assert 0 <= min(r["hit_rate"] for r in engine) <= 1
    assert "| row |" in result["table"]
