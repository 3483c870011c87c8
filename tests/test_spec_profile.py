"""tools/spec_profile.py end to end in a subprocess (it wraps the stepper's methods to time them, so it must not
run inside the test process): on the bundled demo model it times MTP drafting and verification op by op and
writes the JSON it promises. No timing assertions: speed is measured, never asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_spec_profile_splits_a_speculative_step_by_op(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "spec_profile.py"), "--tokens", "12", "--repeat", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "a speculative step yields" in proc.stdout
    r = json.loads(out.read_text())
    assert r["spec"] == "mtp" and r["depth"] == 1 and r["steps"]["off"] == 11
    assert r["steps"]["draft"] == r["steps"]["verify"] > 0 and r["steps"]["plain"] == 0  # every step speculates
    for phase in ("off", "draft", "verify"):
        assert r["totals_ms"][phase] > 0
    rows = r["ms_per_step"]
    assert rows["attention"]["verify"] > 0 and rows["mtp_input"]["draft"] > 0 and rows["mtp_input"]["off"] == 0
    assert r["tokens_per_spec_step"] >= 1.0 and r["spec_step_speedup"] > 0
