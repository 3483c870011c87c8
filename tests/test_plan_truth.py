"""`plan` tells the truth about the machine (issue 46 item 5): without --hardware it plans for the machine it runs
on (its cores, RAM and GPU as the OS reports them), --ram-total plans for another amount, a plan that does not fit
exits non-zero with the reason, and the what-ifs are only changes a user can make (a flag, a format, a shipped
hardware profile), never a made-up machine."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from offload_engine.cli import main
from offload_engine.defaults import PACKAGE_MODEL
from offload_engine.planner.hardware import list_profiles, load_profile
from offload_engine.planner.plan import PlanOptions, load_model_spec, model_shape, plan
from offload_engine.planner.what_ifs import what_ifs
from offload_engine.units import format_bytes, parse_bytes

FLAGS = ("--ram ", "--vram ", "--context ", "--kv-dtype ", "--spec ", "--host-compute", "--weights ", "--hardware ")


def os_ram_total() -> int:
    """MemTotal from /proc/meminfo, limited by the cgroup's memory.max: what the kernel says, read here."""
    kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal:"))
    total = kib * 1024
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.is_file() and limit.read_text().strip() != "max":
        total = min(total, int(limit.read_text()))
    return total


def plan_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="reads /proc/meminfo")
def test_plan_without_hardware_is_this_machine(capsys):
    code, out, _ = plan_cli(capsys, "--model", str(PACKAGE_MODEL), "--json")
    assert code == 0
    j = json.loads(out)
    assert j["hardware"] == "this machine"
    assert j["memory"]["host"]["physical"] == os_ram_total()
    cores = len(os.sched_getaffinity(0))
    assert f"{cores} CPU cores" in j["hardware_description"]
    code, text, _ = plan_cli(capsys, str(PACKAGE_MODEL))  # the model as a positional path, the text report
    assert code == 0
    header = text.splitlines()[:3]
    assert "on this machine" in header[0] and format_bytes(os_ram_total()) in header[1]
    if torch.cuda.is_available():
        assert torch.cuda.get_device_name(0) in header[2]
    else:
        assert "no GPU" in header[1] and "no GPU" in header[2]
    assert "rtx4070" not in header[0]
    # the context as `run` reserves it: the demo model's 2048 positions, not the 4096 default beyond them
    assert re.search(r"context 2048\b", header[0])


def test_ram_total_changes_the_check(capsys):
    code, out, err = plan_cli(capsys, "Qwen3-30B-A3B", "--ram", "16GiB", "--ram-total", "64GiB", "--json")
    j = json.loads(out)
    assert code == 0 and j["memory"]["host"]["physical"] == 64 << 30 and j["fit"]["RAM"]["fits"]
    code, out, err = plan_cli(capsys, "Qwen3-30B-A3B", "--ram-total", "64GiB", "--json")
    j = json.loads(out)  # no --ram: the budget follows the RAM given, less the reserve and the activations
    host = j["memory"]["host"]
    assert code == 0 and host["budget"] == (64 << 30) - host["reserve"] - host["activations"]


def test_a_plan_that_does_not_fit_exits_3_with_the_reason(capsys):
    code, out, err = plan_cli(capsys, "Qwen3-30B-A3B", "--ram", "16GiB", "--ram-total", "8GiB")
    assert code == 3
    assert "DOES NOT FIT" in out  # the report is still printed
    assert "does not fit this machine" in err and "the largest --ram that fits is" in err
    code, out, err = plan_cli(capsys, "Qwen3-30B-A3B", "--hardware", "rtx4070-12gb", "--vram", "20GiB")
    assert code == 3 and "VRAM:" in err and "12.00 GiB of rtx4070-12gb" in err
    code, _, err = plan_cli(capsys, "Qwen3-30B-A3B", "--ram-total", "lots")
    assert code == 2 and "--ram-total" in err


@pytest.mark.parametrize("model, hardware, options", [
    ("Qwen3-30B-A3B", "rtx4070-12gb", PlanOptions(vram=10 << 30, ram=24 << 30)),
    ("Qwen3-30B-A3B", None, PlanOptions(ram=8 << 30)),
    ("DeepSeek-V3", "rtx4090-24gb", PlanOptions(weights="int4", spec="mtp")),
    ("Llama-3.1-70B", "v100-16gb-pcie3", PlanOptions()),
])
def test_what_ifs_are_changes_a_user_can_make(model, hardware, options):
    from offload_engine.planner.hardware import this_machine

    profile = load_profile(hardware) if hardware else this_machine()
    base = plan(model_shape(load_model_spec(model)), profile, options)
    ifs = what_ifs(base)
    assert ifs
    largest_vram = max(load_profile(n).vram_bytes for n in list_profiles())
    for w in ifs:
        assert w.change.startswith(FLAGS), w.change
        flag, value = (w.change.split() + [""])[:2]
        if flag == "--vram":
            assert parse_bytes(value) <= min(profile.vram_bytes, largest_vram), w.change
        elif flag == "--ram":
            assert parse_bytes(value) <= profile.ram_bytes, w.change
        elif flag == "--hardware":
            assert value in list_profiles() and value != profile.name
        assert "x2" not in w.change and "->" not in w.change  # no bandwidth doubled, no memory made up


def test_plan_warns_of_a_context_beyond_the_model(capsys):
    code, out, _ = plan_cli(capsys, str(PACKAGE_MODEL), "--context", "100000")
    assert code == 0 and "--context 100000 exceeds the 2048 positions" in out
