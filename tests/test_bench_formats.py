"""tools/bench_formats.py --quick end to end in a subprocess (tiny checkpoint in five formats, a few seconds): it
builds the checkpoints into its cache, reuses them, runs the engine at 25% on each and writes the JSON it
promises. No timing assertions: speed is measured, never asserted; bytes are."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ["fp32", "bf16", "fp8-block", "ct-int8", "ct-int4"]


def _run(cache: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench_formats.py"), "--quick", "--no-progress",
                           "--cache-dir", str(cache), "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_quick_run_builds_runs_and_reports(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "formats.json"
    proc = _run(cache, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tok/s" in proc.stdout and "MB/tok" in proc.stdout
    result = json.loads(out.read_text())
    assert {"command", "machine", "versions", "engine_source", "settings", "models", "rows"} <= set(result)
    assert result["settings"]["budget_pct"] == 25 and result["settings"]["preset"] == "offload"
    rows = {r["format"]: r for r in result["rows"]}
    assert list(rows) == FORMATS
    for fmt, r in rows.items():
        e = r["engine"]
        assert r["decode_tok_s"] > 0 and 0 <= r["hit_rate"] <= 1 and e["direct_io"]
        assert e["bytes_read_disk_per_token"] > 0 and len(e["tokens"]) == 5  # 25%: really streamed
        assert e["peak_bytes"]["host"] <= e["budget_bytes"]["host"]
        assert r["unit_bytes"]["expert"] > 0 and (r["quant_method"] is None) == (fmt in ("fp32", "bf16"))
    assert rows["bf16"]["size_vs_bf16"] == 1.0 and rows["fp32"]["size_vs_bf16"] > 1.9
    for fmt in ("fp8-block", "ct-int8", "ct-int4"):  # fewer bytes on disk, per expert unit and read per token
        r = rows[fmt]
        assert r["size_vs_bf16"] < 0.6 and r["unit_bytes"]["expert"] < 0.6 * rows["bf16"]["unit_bytes"]["expert"]
        assert r["bytes_per_token_vs_bf16"] < 1.0
    assert rows["ct-int4"]["unit_bytes"]["expert"] < rows["ct-int8"]["unit_bytes"]["expert"]
    built = {p: p.stat().st_mtime_ns for p in cache.glob("*/config.json")}
    assert len(built) == 5
    again = _run(cache, tmp_path / "again.json", "--formats", "bf16,ct-int4")  # the cache is reused
    assert again.returncode == 0, again.stderr[-4000:]
    assert {p: p.stat().st_mtime_ns for p in cache.glob("*/config.json")} == built
    assert [r["format"] for r in json.loads((tmp_path / "again.json").read_text())["rows"]] == ["bf16", "ct-int4"]


def test_bad_formats_are_refused(tmp_path):
    proc = _run(tmp_path, tmp_path / "x.json", "--formats", "bf16,q4_k")
    assert proc.returncode == 2 and "q4_k" in proc.stderr
    proc = _run(tmp_path, tmp_path / "x.json", "--formats", "ct-int4", "--same-bytes")
    assert proc.returncode == 2 and "--same-bytes needs bf16" in proc.stderr
