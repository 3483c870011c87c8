"""Host compute: experts the host tier holds and the device tier does not, computed where they lie in RAM.

On the CPU (--vram makes a RAM pool the device tier) "on" computes them in place, bit for bit as the device pool
would; the cost rule that "auto" applies on a GPU is checked on the rates of real machines."""
from __future__ import annotations

import json

import pytest
import torch

from offload_engine import Budget, Engine
from offload_engine.cli import main
from offload_engine.errors import ConfigError
from offload_engine.planner.costs import Machine, host_compute_pays
from offload_engine.probe import last_level_cache_bytes, measure_cpu_gemv_bandwidth
from offload_engine.runtime.host_compute import OBSERVED_MIN, HostCompute
from tests.test_store import CONTEXT, NEW, PROMPT, run


@pytest.fixture(scope="module", autouse=True)
def on_the_cpu():
    """These checks are the CPU's, bit for bit, whatever OFFLOAD_ENGINE_DEVICE the runner set: on a GPU a CPU
    sums in another order (tests/test_cuda.py holds the GPU's: same tokens, logits to rounding)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFLOAD_ENGINE_DEVICE", "cpu")
        yield


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "deepseek_v3"])
def resident(request, checkpoint_factory):
    path = checkpoint_factory(request.param, "offload")
    logits, completion = run(path)
    return path, logits, completion


@pytest.mark.parametrize("vram,ram", [("8%", "100%"), ("8%", "40%")])
def test_host_compute_on_matches_resident_bitwise(resident, vram, ram):
    path, ref_logits, ref = resident
    logits, completion = run(path, budget=Budget(vram=vram, ram=ram), host_compute="on")
    assert torch.equal(logits, ref_logits)
    assert completion.token_ids == ref.token_ids
    stats = completion.stats
    assert stats["host_computed"] > 0
    if ram == "100%":  # every expert lies in RAM: none is ever copied to the device tier
        assert stats["bytes_host_to_device"] == 0
    for tier in ("device", "host"):
        assert stats["peak_bytes"][tier] <= stats["budget_bytes"][tier]


def test_off_and_auto_on_a_cpu_compute_nothing_on_the_host(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    for mode in ("off", "auto"):  # auto: the rule never picks the host where compute already runs on the CPU
        _, completion = run(path, budget=Budget(vram="8%", ram="100%"), host_compute=mode)
        assert completion.stats["host_computed"] == 0 and completion.stats["bytes_host_to_device"] > 0


def test_a_stream_stopped_early_gives_back_its_host_references(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(vram="8%", ram="100%"), max_context=CONTEXT, host_compute="on") as engine:
        stream = engine.stream(PROMPT, max_new_tokens=NEW, ignore_eos=True)
        next(stream)
        stream.close()
        assert all(slot.refs == 0 for pool in engine.store.host.pools.values() for slot in pool)
        assert engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True).stats["host_computed"] > 0


def test_unknown_mode_is_refused(checkpoint_factory):
    with pytest.raises(ConfigError, match="--host-compute"):
        Engine.open(checkpoint_factory("qwen3_moe", "offload"), host_compute="cpu")


def machine(h2d_gbps: float, cpu_gbps: float, cpu_tflops: float) -> Machine:
    return Machine("gpu", weight_gbps=3000.0, flops=500e12, op_us=8.0, h2d_gbps=h2d_gbps, nvme_gbps=5.0,
                   nvme_latency_us=80.0, cpu_gbps=cpu_gbps, cpu_flops=cpu_tflops * 1e12, cpu_op_us=6.0)


EXPERT = (2 * 3 * 2048 * 768, 3 * 2048 * 768)  # a Qwen3-30B-A3B expert in bf16: bytes, parameters


def test_the_rule_weighs_the_link_against_the_cpu():
    pcie4_desktop = machine(h2d_gbps=25.0, cpu_gbps=45.0, cpu_tflops=1.0)
    assert host_compute_pays(*EXPERT, 1, pcie4_desktop)  # decode: one token reads the expert once, no copy
    assert not host_compute_pays(*EXPERT, 256, pcie4_desktop)  # prefill: the CPU's FLOPs lose
    h200_box = machine(h2d_gbps=55.5, cpu_gbps=20.0, cpu_tflops=1.0)  # the H200 machine's pinned copy rate
    assert not host_compute_pays(*EXPERT, 1, h200_box)
    cpu_engine = Machine("cpu", 20.0, 1e12, 6.0, None, 2.0, 80.0, 20.0, 1e12, 6.0)
    assert not host_compute_pays(*EXPERT, 1, cpu_engine)


def test_stats_show_the_rules_two_sides():
    """auto's summary (stats["host_compute"]) holds both sides of the rule for one token, so a run shows why."""
    for box in (machine(h2d_gbps=25.0, cpu_gbps=45.0, cpu_tflops=1.0), machine(55.5, 20.0, 1.0)):
        auto = HostCompute("auto", box, *EXPERT)
        summary = auto.snapshot()
        assert (summary["host_expert_us"] < summary["copied_expert_us"]) == auto.wants(1)
        assert summary["cpu_gbps"] == box.cpu_gbps and summary["h2d_gbps"] == box.h2d_gbps
    assert HostCompute("on", None, *EXPERT).snapshot() == {"mode": "on"}


def test_auto_stops_where_observed_times_say_the_host_loses():
    """auto weighs what host-computed experts took in this engine, not only the probes: decode's observations
    (few tokens) enter a running average; a prefill's many-token expert leaves it alone."""
    auto = HostCompute("auto", machine(h2d_gbps=25.0, cpu_gbps=45.0, cpu_tflops=1.0), *EXPERT)
    assert auto.wants(1)
    auto.observe(1e-4, 256)  # prefill: not decode's rate
    auto.observe(3e-3, 1)  # the first, cold call: left out
    assert auto.observed_s is None and auto.wants(1)
    for _ in range(OBSERVED_MIN - 2):  # the H200 machine's decode expert on the host, warm
        auto.observe(0.9e-3, 1)
    assert auto.wants(1)  # too few yet to overrule the estimate
    auto.observe(0.9e-3, 1)
    assert not auto.wants(1) and auto.snapshot()["observed_host_expert_us"] == pytest.approx(900)
    on = HostCompute("on", None, *EXPERT)
    on.observe(1.0, 1)
    assert on.wants(1)  # on computes every one, whatever it takes


def test_the_model_asks_the_host_only_where_auto_says_it_pays(resident):
    """CausalLM._moe with an auto HostCompute on given rates: where the CPU wins, experts are handed over (here
    computed in place on the CPU, bit for bit); where it loses, none are (on a GPU the forward then also skips
    staging its routing inputs on the host, which this CPU run cannot see)."""
    path, _, ref = resident
    with Engine.open(path, budget=Budget(vram="8%", ram="100%"), max_context=CONTEXT) as engine:
        for box, computed in ((machine(h2d_gbps=25.0, cpu_gbps=45.0, cpu_tflops=1.0), True),
                              (machine(h2d_gbps=55.5, cpu_gbps=20.0, cpu_tflops=1.0), False)):
            engine.model.host_compute = HostCompute("auto", box, *EXPERT)
            completion = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
            assert completion.token_ids == ref.token_ids
            assert (completion.stats["host_computed"] > 0) == computed


def test_the_cpu_probe_reads_past_the_cache_and_gives_its_memory_back():
    """auto's CPU rate: GEMVs over 4x the last-level cache (sysfs "32768K" parsed to bytes), in one allocation
    that returns to the OS (the H200 run's RSS grew 1 GiB over the host budget with 8 MiB blocks glibc kept)."""
    import psutil

    llc = last_level_cache_bytes()
    assert llc is None or 16 << 10 <= llc <= 4 << 30
    process = psutil.Process()
    freed = torch.ones(6 << 20)  # a freed 24 MiB block raises glibc's mmap threshold, as a model's run would
    del freed
    before = process.memory_info().rss
    rate = measure_cpu_gemv_bandwidth(torch.bfloat16)
    assert rate.nbytes >= min(max(256 << 20, 4 * (llc or 0)), 1 << 30) - rate.block and rate.bytes_per_s > 0
    assert process.memory_info().rss - before < 32 << 20


def test_cli_host_compute_flag(checkpoint_factory, capsys):
    path = checkpoint_factory("qwen3_moe", "offload")
    base = ["run", "--model", str(path), "--vram", "8%", "--ram", "100%", "--context", "64", "--max-new-tokens", "8",
            "--json", "--quiet", "--prompt", "x"]
    outs = []
    for mode in ("off", "on"):
        capsys.readouterr()
        assert main(base + ["--host-compute", mode]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    assert outs[0]["stats"]["host_computed"] == 0 < outs[1]["stats"]["host_computed"]
    assert [o["stats"]["host_compute"]["mode"] for o in outs] == ["off", "on"]
