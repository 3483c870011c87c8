"""tools/bench.py --quick end to end in a subprocess: it runs, writes the JSON it promises, and the engine and the
accelerate peer produce the same greedy tokens. No timing assertions: speed is measured, never asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ENGINE_KEYS = {"tokens", "tok_s", "s_per_token", "bytes_read_disk_per_token", "hit_rate", "stall_s_per_token",
               "peak_bytes", "budget_bytes", "direct_io"}
PEER_KEYS = {"tokens", "tok_s", "s_per_token", "page_cache", "bytes_on_disk", "os_read_bytes_per_token"}


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("bench")
    out = work / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--no-progress",
                           "--work-dir", str(work), "--json", str(out), "--plot"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tok/s" in proc.stdout
    assert (work / "bench-tok_s.png").stat().st_size > 0 and (work / "bench-bytes.png").stat().st_size > 0
    return json.loads(out.read_text())


def test_json_has_the_figures(result):
    assert {"command", "machine", "versions", "engine_source", "model", "settings", "probe", "resident", "rows",
            "targets"} <= set(result)
    assert {"nproc", "cpu_model"} <= set(result["machine"])
    assert {"torch", "transformers", "accelerate"} <= set(result["versions"])
    assert result["probe"]["disk_bandwidth_start_end"] > 0
    assert all(d["method"] for d in result["probe"]["disk"])
    assert [r["budget_pct"] for r in result["rows"]] == [100, 25]
    for row in result["rows"]:
        assert ENGINE_KEYS <= set(row["engine"])
        assert set(row["peers"]) == {"bypass", "allow"}
        for peer in row["peers"].values():
            assert PEER_KEYS <= set(peer)
        assert row["bound_s_per_token"] > 0 and row["engine_vs_bound"] > 0
        assert row["disk_bw"] > 0 and len(row["disk_around"]) == 2  # the row's own O_DIRECT samples
    below = result["rows"][1]["engine"]
    assert below["read_bytes_per_busy_s"] > 0
    assert below["direct_io"] and below["bytes_read_disk_per_token"] > 0  # 25%: really streamed, page cache bypassed
    assert below["peak_bytes"]["host"] <= below["budget_bytes"]["host"]
    assert set(result["targets"]) >= {"engine_vs_peer_bypass", "engine_vs_peer_page_cache", "engine_vs_physical_bound"}


def test_engine_and_peer_tokens_match(result):
    steps = result["settings"]["tokens"]
    for row in result["rows"]:
        engine = row["engine"]["tokens"]
        assert len(engine) == steps + 1  # the prefill's token, then one per decode step
        for mode, peer in row["peers"].items():
            assert peer["tokens"] == engine, (row["budget_pct"], mode)
        assert all(row["tokens_match"].values())


def test_probe_reads_the_file_and_says_how(tmp_path):
    from offload_engine import probe

    path = tmp_path / "data.bin"
    path.write_bytes(b"\x01" * (3 * 4096 + 100))  # unaligned tail: O_DIRECT over-reads, the count must not
    direct = probe.measure_direct_read_bandwidth(path, block=8192, threads=2)
    assert direct.nbytes == path.stat().st_size and direct.bytes_per_s > 0
    buffered = probe.measure_direct_read_bandwidth(path, block=8192, opener=lambda p: None)  # O_DIRECT refused
    assert buffered.method == "buffered + POSIX_FADV_DONTNEED" and buffered.nbytes == direct.nbytes
    assert probe.measure_cpu_matmul_flops(n=64, repeats=1).flops_per_s > 0
    assert probe.measure_memcpy_bandwidth(nbytes=1 << 20, repeats=1).bytes_per_s > 0


def test_plots_from_rows(tmp_path):
    """Both plots from made-up rows (no bench run): engine only, and engine with both peer modes."""
    from tools.bench_common import EngineRun, PeerRun, Row
    from tools.bench_report import plot_bytes, plot_paths, plot_speed

    def engine(pct, tok_s):
        return EngineRun(pct, [1], 4, 4 / tok_s, 1 / tok_s, tok_s, 3e6, 2e6, 3e6, 0.5, 0.01, 1.0, 0.0, {}, {},
                         True, 0.1, bytes_host_to_device_per_token=1e6 if pct == 25 else 0.0)

    def peer(pct, mode):
        return PeerRun(pct, mode, [1], 4, 8.0, 2.0, 0.5, 5e6 if mode == "bypass" else 0.0, 1.0, 0.0, 9e6, 1e6, 1.0)

    rows = [Row(p, engine(p, t), {m: peer(p, m) for m in ("bypass", "allow")} if p < 100 else {}, 0.05,
                (0.05, 0.05), 2e9, (2e9, 2e9), 0.1, 2.0, {})
            for p, t in ((100, 8.0), (25, 3.0))]
    speed, nbytes = plot_paths("", str(tmp_path / "bench.json"))
    assert (speed.name, nbytes.name) == ("bench-tok_s.png", "bench-bytes.png")
    plot_speed(rows, engine(None, 9.0), speed)
    plot_bytes(rows, nbytes)
    assert speed.stat().st_size > 0 and nbytes.stat().st_size > 0
    plot_bytes([Row(25, engine(25, 3.0), {}, 0.05, (0.05, 0.05), 2e9, (2e9, 2e9), 0.1, 2.0, {})], nbytes)  # engine only


def test_prefetch_modes_are_compared_over_rounds(tmp_path):
    """With several --prefetch modes, a second table compares each with off (the route-ahead columns included);
    with --rounds, every mode runs in every round between resident runs, and the row is the median round."""
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--no-progress", "--no-peer",
                           "--prefetch", "on,off", "--rounds", "3", "--policy", "layer-lru",
                           "--work-dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = next(line for line in proc.stdout.splitlines() if "pay-check verdicts" in line)
    assert "ahead" in header and "RA" in header
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[1:2] in (["on"], ["off"])]
    assert {(r[0], r[1]) for r in rows} == {("100", "on"), ("100", "off"), ("25", "on"), ("25", "off")}
    result = json.loads(out.read_text())
    assert result["settings"]["policy"] == "layer-lru"
    for row in result["rows"]:
        rounds = result["rounds"][f"{row['budget_pct']:g}"]
        assert len(rounds["resident_s_per_token"]) == 4 and len(rounds["engine_s_per_token"]["off"]) == 3
        ratios = row["rounds_vs_bound"]
        assert len(ratios) == 3 and row["engine_vs_bound"] == sorted(ratios)[1] == ratios[row["median_round"]]
        assert row["engine"]["s_per_token"] in rounds["engine_s_per_token"]["on"]
