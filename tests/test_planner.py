"""The planner: exact placements on toy byte sizes, budgets refused with numbers, the planner's sizes and
placement equal to what the store computes from a real checkpoint, the cost model's arithmetic, hardware
profiles, and the plan / probe / calibrate commands."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_engine.errors import BudgetError, ConfigError
from offload_engine.planner import costs
from offload_engine.frontend.calibrate import calibrate, scale_markdown, scale_rows
from offload_engine.planner.hardware import (HARDWARE_DIR, HardwareProfile, list_profiles, load_profile, probe,
                                             save_profile)
from offload_engine.planner.formats import WeightFormat
from offload_engine.planner.placement import KindSize, Placement, ResolvedBudget, kind_sizes, plan_placement
from offload_engine.planner.plan import PlanOptions, load_model_spec, model_shape, plan
from offload_engine.planner.what_ifs import what_ifs
from offload_engine.frontend.plan_report import memory_table, plan_json, plan_text

ROOT = Path(__file__).resolve().parents[1]
CPU = HardwareProfile(name="toy-cpu", description="", vram_bytes=0, ram_bytes=64 << 30, gpu_mem_gbps=0,
                      gpu_tflops=0, pcie_gbps=0, ram_gbps=10, cpu_gemv_gbps=20, cpu_gflops=100, nvme_gbps=1,
                      nvme_latency_us=50, cpu_op_us=5)
GPU = CPU.with_changes(name="toy-gpu", vram_bytes=16 << 30, gpu_mem_gbps=800, gpu_tflops=100, pcie_gbps=25)


# ---- exact placements on toy byte sizes (accelerate's style) ----------------------------------------------------
TOY = {"embed": KindSize("embed", 1, 100), "head": KindSize("head", 1, 100), "dense": KindSize("dense", 4, 50),
       "expert": KindSize("expert", 16, 10)}


def test_toy_placement_exact():
    p = plan_placement(TOY, compute_budget=400, host_budget=1000, kv_bytes=20, staging_bytes=8)
    device, host = p.tiers
    # minimum working set 100 (head) + 2 x 50 + 2 x 10 + 20 KV = 240 (the embedding needs no slot); 160 left:
    # dense whole (+100); the embedding only with room for all the rest, which there is not; 6 more experts
    assert device.slots == {"head": 1, "dense": 4, "expert": 8}
    assert sorted(device.pinned) == ["dense", "head"]
    assert device.used(TOY) == 400
    # the host holds all the rest, so it holds the embedding too: lookups gather their rows from it
    assert host.slots == {"embed": 1, "expert": 16} and sorted(host.pinned) == ["embed", "expert"]
    assert host.used(TOY) == 8 + 100 + 160
    assert p.home("dense") == "device" and p.home("expert") == "host" and p.home("embed") == "host"
    assert not p.by_rows("embed")


def test_toy_staging_invariant_room_for_the_largest_unit_below():
    """Every kind not pinned on the compute tier keeps slots there for its largest unit (two where the kind has
    several units, so a read lands while another unit computes)."""
    p = plan_placement(TOY, compute_budget=300, host_budget=50, kv_bytes=20)
    device = p.tiers[0]
    for kind, size in TOY.items():
        if kind not in device.pinned and not p.by_rows(kind):
            assert device.slots[kind] * size.slot_bytes >= min(2, size.count) * size.slot_bytes
    assert p.home("dense") == "disk" and p.tiers[1].slots == {"dense": 1}  # host: what fits, 50 B
    assert p.by_rows("embed") and "embed" not in device.slots  # read by rows: no slot anywhere


def test_toy_cuda_host_staging_exact():
    """CUDA reads stage through host slots: `host_staging` slots of every kind (one per reader thread, at most the
    kind's unit count), each the size of the kind's largest unit, are reserved on the host before anything else;
    kinds pinned on the device keep theirs (their units load through the host too)."""
    p = plan_placement(TOY, compute_budget=400, host_budget=500, kv_bytes=20, staging_bytes=8, host_staging=4)
    device, host = p.tiers
    # the embedding is read by rows: its row cache (1/64 of the budget, 6 B) takes the place of an expert slot
    assert device.slots == {"head": 1, "dense": 4, "expert": 7} and device.row_cache_bytes == 6
    assert device.used(TOY) == 396
    # staging: head 100 + dense 4 x 50 + expert 4 x 10 + 8 bounce = 348 (the device cannot hold everything, so
    # the embedding is read by rows and needs no staging slot); 152 left: 12 more expert slots pin all experts,
    # and the embedding (100) does not fit beside them
    assert host.staging_slots == {"head": 1, "dense": 4, "expert": 4}
    assert host.slots == {"head": 1, "dense": 4, "expert": 16}
    assert host.pinned == ["expert"] and host.used(TOY) == 8 + 100 + 200 + 160 == 468
    assert p.by_rows("embed")
    for kind, size in TOY.items():  # the invariant: room on the host for the largest unit of every kind below it
        if not p.by_rows(kind):
            assert host.slots[kind] >= min(4, size.count) and p.sizes[kind].slot_bytes == size.slot_bytes
    assert Placement.from_json(p.to_json()).tiers[1].staging_slots == host.staging_slots
    assert "reserved as staging" in p.describe()


def test_toy_cuda_host_staging_refused_one_byte_short():
    ok = plan_placement(TOY, compute_budget=400, host_budget=348, kv_bytes=20, staging_bytes=8, host_staging=4)
    assert ok.tiers[1].used(TOY) == 348 and ok.tiers[1].slots == {"head": 1, "dense": 4, "expert": 4}
    with pytest.raises(BudgetError) as e:
        plan_placement(TOY, compute_budget=400, host_budget=347, kv_bytes=20, staging_bytes=8, host_staging=4)
    assert e.value.resource == "host" and e.value.required == 348 and e.value.available == 347
    assert "dense x4=200 B" in str(e.value) and "disk -> host -> device" in str(e.value)
    # without host staging (the CPU engine reads disk -> compute slot) the same budget is fine
    cpu = plan_placement(TOY, compute_budget=400, host_budget=100, kv_bytes=20, staging_bytes=8)
    assert cpu.tiers[1].staging_slots == {} and cpu.tiers[1].slots == {"expert": 9}


@settings(max_examples=300, deadline=None)
@given(counts=st.tuples(st.integers(1, 8), st.integers(1, 64)), unit=st.tuples(*[st.integers(1, 1 << 16)] * 4),
       compute=st.one_of(st.none(), st.integers(0, 1 << 22)), host=st.one_of(st.none(), st.integers(0, 1 << 22)),
       kv=st.integers(0, 1 << 16), staging=st.integers(0, 1 << 12), threads=st.integers(1, 4))
def test_host_staging_invariant_holds_or_is_refused_with_numbers(counts, unit, compute, host, kv, staging, threads):
    sizes = {"embed": KindSize("embed", 1, unit[0]), "head": KindSize("head", 1, unit[1]),
             "dense": KindSize("dense", counts[0], unit[2]), "expert": KindSize("expert", counts[1], unit[3])}
    try:
        p = plan_placement(sizes, compute, host, kv, staging, host_staging=threads)
    except BudgetError as e:
        assert e.required > e.available and e.breakdown
        return
    device, tier = p.tiers
    for kind, size in sizes.items():
        if kind == "embed" and "embed" not in device.pinned:  # read by rows or from the host: no staging slot
            assert kind not in tier.staging_slots
            assert p.home(kind) == "host" or p.by_rows(kind)
            continue
        assert tier.staging_slots[kind] == min(threads, size.count) <= tier.slots[kind]
        assert p.home(kind) != "disk" or device.slots[kind] >= 1
    for t in p.tiers:
        assert t.budget is None or t.used(sizes) <= t.budget


def test_toy_host_staging_caps_at_the_unit_count():
    p = plan_placement(TOY, compute_budget=None, host_budget=None, kv_bytes=0, host_staging=2)
    device, host = p.tiers
    assert sorted(device.pinned) == ["dense", "embed", "expert", "head"]
    assert host.slots == host.staging_slots == {"embed": 1, "head": 1, "dense": 2, "expert": 2}


def test_toy_infeasible_budget_names_the_numbers():
    with pytest.raises(BudgetError) as e:
        plan_placement(TOY, compute_budget=239, host_budget=1000, kv_bytes=20)
    msg = str(e.value)
    assert "device budget too small" in msg and "(240 bytes)" in msg and "(239 bytes)" in msg
    assert "kv cache=20 B" in msg and "expert x2=20 B" in msg and "embed" not in msg
    assert e.value.required == 240 and e.value.available == 239


def test_toy_single_tier():
    p = plan_placement(TOY, compute_budget=500, host_budget=None, kv_bytes=0, separate_host=False)
    assert len(p.tiers) == 1 and p.tiers[0].name == "host"
    assert p.tiers[0].slots == {"head": 1, "dense": 4, "expert": 16} and p.by_rows("embed")
    whole = plan_placement(TOY, compute_budget=560, host_budget=None, kv_bytes=0, separate_host=False)
    assert whole.tiers[0].slots == {"head": 1, "dense": 4, "embed": 1, "expert": 16} and not whole.streams


# ---- the planner agrees with the store on real checkpoints --------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_planned_sizes_and_placement_equal_the_store(checkpoint_factory, arch):
    import torch

    from offload_engine.checkpoint.model import open_model
    from offload_engine.store.build import plan_for

    ck = open_model(checkpoint_factory(arch))
    shape = model_shape(load_model_spec(str(ck.root)))
    units = shape.bytes_of(WeightFormat.of(shape.spec, None), False)
    assert kind_sizes(units) == kind_sizes({key: layout.nbytes for key, layout in ck.layouts.items()})
    assert sum(units.values()) == ck.total_bytes
    ram = int(ck.total_bytes * 0.6) + (1 << 20)  # + the O_DIRECT bounce buffers of a tiny model
    p = plan(shape, CPU, PlanOptions(ram=ram, context=64, direct_io="on"))
    from offload_engine.runtime.arch import build_ops

    ops = build_ops(ck.arch.name, ck.args, torch.device("cpu"), torch.float32)
    engine, direct = plan_for(ck, ResolvedBudget(device=None, host=ram), torch.device("cpu"),
                              64 * ops.kv_bytes_per_token(4), "on")
    assert p.kv_bytes == 64 * ops.kv_bytes_per_token(4)
    assert json.loads(p.placement.to_json()) == json.loads(engine.to_json()) and direct == p.direct_io


@pytest.mark.parametrize("quant", ["ct-int4", "ct-int8", "gptq", "fp8-block"])
def test_planned_kernel_room_equals_the_store(checkpoint_factory, quant):
    """On a CPU the slots of a quantized checkpoint also hold their units' kernel forms: the plan sizes them
    as the engine does (planner/kernel_room.py), so both place the same slots."""
    import torch

    from offload_engine.checkpoint.model import open_model
    from offload_engine.runtime.arch import build_ops
    from offload_engine.runtime.kernels.select import slot_room
    from offload_engine.store.build import plan_for

    cpu = torch.device("cpu")
    ck = open_model(checkpoint_factory("qwen3_moe", quant=quant))
    shape = model_shape(load_model_spec(str(ck.root)))
    fmt = WeightFormat.of(shape.spec, None)
    room = {key: slot_room(layout, cpu, torch.float32) for key, layout in ck.layouts.items()}
    # every decoder unit has quantized linear weights a kernel takes (embeddings and head are kept as floats)
    assert all(n > 0 for k, n in room.items() if k.kind in ("dense", "expert"))
    with_room = shape.bytes_of(fmt, False, 4)
    assert kind_sizes(with_room) == kind_sizes({k: layout.nbytes + room[k] for k, layout in ck.layouts.items()})
    ram = int(ck.total_bytes * 0.6) + (1 << 20)
    p = plan(shape, CPU, PlanOptions(ram=ram, context=64, direct_io="on"))
    ops = build_ops(ck.arch.name, ck.args, cpu, torch.float32)
    engine, _ = plan_for(ck, ResolvedBudget(device=None, host=ram), cpu, 64 * ops.kv_bytes_per_token(4), "on",
                         lambda layout: slot_room(layout, cpu, torch.float32))
    assert json.loads(p.placement.to_json()) == json.loads(engine.to_json())


def test_plan_refuses_infeasible_budget_with_numbers():
    shape = model_shape(load_model_spec("Qwen3-30B-A3B"))
    with pytest.raises(BudgetError) as e:
        plan(shape, GPU, PlanOptions(vram=512 << 20, ram=64 << 30))
    assert "device budget too small" in str(e.value) and e.value.available == 512 << 20


def test_cuda_plan_reserves_host_staging_for_every_kind(qwen):
    from offload_engine.constants import READER_THREADS

    with pytest.raises(BudgetError) as e:
        plan(qwen, GPU, PlanOptions(vram=12 << 30, ram=8 << 20))  # the 594 MiB head's staging slot alone
    assert e.value.resource == "host" and "disk -> host -> device" in str(e.value)
    p = plan(qwen, GPU, PlanOptions(vram=12 << 30, ram=4 << 30))
    host, sizes = p.placement.tiers[1], p.placement.sizes
    assert host.staging_slots == {k: min(READER_THREADS, s.count) for k, s in sizes.items() if k != "embed"}
    assert all(host.slots[k] >= n for k, n in host.staging_slots.items())
    assert p.placement.by_rows("embed") and "embed" not in host.slots  # 30B on 12 GiB: lookups read rows
    assert memory_table(p)["host"]["staging_slots"] == sum(n * sizes[k].slot_bytes
                                                           for k, n in host.staging_slots.items())
    cpu = plan(qwen, CPU, PlanOptions(vram=12 << 30, ram=4 << 30))  # the CPU engine reads into compute slots
    assert cpu.placement.tiers[1].staging_slots == {}


def test_activations_and_cuda_reserve_are_charged(qwen):
    from offload_engine.constants import PREFILL_CHUNK
    from offload_engine.planner.plan import DEVICE_RESERVE, HOST_RESERVE, activation_bytes

    prof = load_profile("rtx4070-12gb")
    p = plan(qwen, prof, PlanOptions(vram=12 << 30, ram=48 << 30, context=4096))
    act = activation_bytes(qwen, 4096, 2)
    s = qwen.spec
    assert act >= PREFILL_CHUNK * s.hidden_size * 2 * 8 + PREFILL_CHUNK * s.vocab_size * 4  # hidden x chunk, logits
    dev, host = memory_table(p)["device"], memory_table(p)["host"]
    assert dev["activations"] == act and dev["reserve"] == DEVICE_RESERVE and host["reserve"] == HOST_RESERVE
    assert dev["total"] == dev["budget_charged"] + act + DEVICE_RESERVE
    j = plan_json(p)
    assert j["fit"]["VRAM"] == {"charged": dev["total"], "physical": 12 << 30, "fits": False}
    assert j["fit"]["RAM"]["fits"] and any("largest --vram that fits" in w for w in p.warnings)
    largest = (12 << 30) - act - DEVICE_RESERVE
    q = plan(qwen, prof, PlanOptions(vram=largest, ram=48 << 30, context=4096))
    fit = plan_json(q)["fit"]["VRAM"]
    assert fit["fits"] and (12 << 30) - fit["charged"] < q.placement.sizes["expert"].slot_bytes  # filled to a slot
    default = plan(qwen, prof, PlanOptions(ram=48 << 30, context=4096))  # the default budget leaves the room
    assert default.placement.compute.budget == largest and not default.warnings


def test_cpu_tiers_share_the_ram_in_the_fit(qwen):
    p = plan(qwen, CPU, PlanOptions(vram=8 << 30, ram=16 << 30, context=1024))
    (need, have), = p.fit.values()
    used = sum(t.used(p.placement.sizes) for t in p.placement.tiers)
    assert list(p.fit) == ["RAM"] and have == CPU.ram_bytes
    assert need == used + p.activations["host"] + p.reserve["host"] and "device" not in p.activations


# ---- cost model ------------------------------------------------------------------------------------------------
GPU_M = costs.Machine.of(GPU, separate_host=True)


def flow(kind="expert", uses=10.0, p_dev=1.0, p_host=0.0, nbytes=1e8, groups=1):
    return costs.Flow(kind, uses, nbytes, nbytes / 2, 1, p_dev, p_host, groups)


def test_all_resident_costs_compute_plus_overhead():
    c = costs.step_cost([flow()], GPU_M)
    assert c.compute_s == pytest.approx(10 * 1e8 / 800e9)
    assert c.overhead_s == pytest.approx(10 * (costs.OPS_PER_UNIT["expert"] * GPU.gpu_op_us
                                               + costs.ENGINE_UNIT_OPS * GPU.cpu_op_us) * 1e-6)
    assert costs.step_cost([flow()], GPU_M, overhead_scale=0).seconds == pytest.approx(c.compute_s)
    assert c.seconds == pytest.approx(c.compute_s + c.overhead_s) and c.pcie_s == 0 and c.nvme_s == 0


def test_misses_cross_pcie_and_nvme_and_name_the_bottleneck():
    host = costs.step_cost([flow(p_dev=0.0, p_host=1.0)], GPU_M)
    assert host.bytes_h2d == pytest.approx(1e9) and host.pcie_s == pytest.approx(1e9 / 25e9)
    assert host.bottleneck == "PCIe" and host.seconds >= host.pcie_s
    disk = costs.step_cost([flow(p_dev=0.0, p_host=0.0)], GPU_M)
    assert disk.bytes_disk == pytest.approx(1e9) and disk.bottleneck == "NVMe"
    per_use = 1e8 / 800e9 + (costs.OPS_PER_UNIT["expert"] * GPU.gpu_op_us + costs.ENGINE_UNIT_OPS * GPU.cpu_op_us) * 1e-6
    wait = costs.layer_wait(10.0, 10.0, disk.nvme_s / 10, per_use)
    assert disk.seconds == pytest.approx(max(disk.compute_s + disk.overhead_s + wait, disk.nvme_s))


def test_a_layer_waits_for_the_reads_its_other_experts_do_not_cover():
    """A4: n ~ Poisson(mean) misses of a layer's u experts are read one after another while it computes the
    u - 1 others; the tail beyond u counts as all u missing."""
    r, c = 2.0, 0.25
    assert costs.layer_wait(0.0, 8, r, c) == 0.0
    assert costs.layer_wait(1e-6, 8, r, c) == pytest.approx(1e-6 * (r - 7 * c), rel=1e-3)  # one miss, rarely
    mean = 1.2
    expected = sum(math.exp(-mean) * mean ** n / math.factorial(n) * max(0.0, n * r - 7 * c) for n in range(1, 8))
    tail = 1.0 - sum(math.exp(-mean) * mean ** n / math.factorial(n) for n in range(8))
    assert costs.layer_wait(mean, 8, r, c) == pytest.approx(expected + tail * (8 * r - 7 * c))
    # reads shorter than the other experts' compute are hidden, but for the rare step that misses all 8
    assert costs.layer_wait(mean, 8, 0.1, c) == pytest.approx(0.0, abs=1e-5)
    hist = (0.5, 0.3, 0.0, 0.2)  # a trace's own counts: bursts of 3 misses weigh more than Poisson's tail
    assert costs.layer_wait(9.9, 8, r, c, hist) == pytest.approx(0.3 * (r - 7 * c) + 0.2 * (3 * r - 7 * c))
    # half of them read ahead: 0.5 and 1.5 demand reads (a lone half read still waits beyond 7.5 experts' work)
    assert costs.layer_wait(9.9, 8, r, c, hist, demand_share=0.5) == pytest.approx(
        0.3 * (r - 7.5 * c) + 0.2 * (1.5 * r - 7 * c))
    # every expert missing, reads faster than compute: the first arrival still waits a whole read
    assert costs.layer_wait(9.9, 8, 0.1, c, (0.0,) * 8 + (1.0,)) == pytest.approx(0.1)


def test_trace_miss_histogram_counts_misses_per_layer_and_token():
    # two MoE layers, per-layer LRU of 2 slots: layer 0 cycles through 3 experts (misses), layer 1 repeats 2
    tokens = [[[0, 1], [5, 6]], [[2, 0], [5, 6]], [[1, 2], [6, 5]]]
    hist = costs.trace_miss_histogram({"tokens": tokens}, 2)
    misses = [2, 2, 2, 0, 2, 0]  # per (token, layer) in order: layer 0 always misses both, layer 1 only at first
    assert hist == tuple(misses.count(n) / 6 for n in range(3))
    assert costs.simulate_trace({"tokens": tokens}, 2, 0)[0] == pytest.approx(1 - sum(misses) / 12)


def test_prefetch_recall_hides_reads_behind_compute():
    slow = GPU_M.__class__(**{**GPU_M.__dict__, "weight_gbps": 1.0})  # compute-heavy: 0.1 s per unit
    cold = costs.step_cost([flow(p_dev=0.0, p_host=1.0, groups=10)], slow, recall=0.0)
    warm = costs.step_cost([flow(p_dev=0.0, p_host=1.0, groups=10)], slow, recall=1.0)
    assert warm.seconds < cold.seconds
    assert warm.seconds == pytest.approx(warm.compute_s + warm.overhead_s)


def test_host_compute_skips_pcie():
    c = costs.step_cost([flow(p_dev=0.0, p_host=1.0)], GPU_M, host_compute=True)
    assert c.pcie_s == 0 and c.cpu_s > 0 and c.bottleneck.startswith("RAM bandwidth")


def test_hit_models():
    assert costs.hit_fraction(0.25, 1.0) == pytest.approx(0.25)
    assert costs.hit_fraction(0.25, 0.5) == pytest.approx(0.5)
    assert costs.hit_fraction(0.0, 0.4) == 0 and costs.hit_fraction(1.0, 0.4) == 1
    assert costs.scan_hit_fraction(3, 10) == pytest.approx(0.2) and costs.scan_hit_fraction(10, 10) == 1
    assert costs.expert_union(128, 8, 1) == pytest.approx(8)
    assert 8 < costs.expert_union(128, 8, 2) < 16
    assert costs.accepted_per_step(1, 0.85) == pytest.approx(1.85)
    assert costs.accepted_per_step(3, 0.5) == pytest.approx(1.875)


def test_trace_simulation():
    trace = {"tokens": [[[0, 1]], [[0, 1]], [[2, 3]], [[0, 1]]]}  # one MoE layer
    dev, host = costs.simulate_trace(trace, device_share=2, host_share=4)
    assert dev == pytest.approx(2 / 8) and host == pytest.approx(4 / 8)
    assert costs.trace_union(trace, 2) == [2.0, 3.0]
    with pytest.raises(ValueError):
        costs.simulate_trace({"tokens": "x"}, 1, 1)
    # tools/trace_experts.py's record: one step per forward and MoE layer, every token of the forward
    record = {"moe_layers": [1], "steps": [[1, [[0, 1], [0, 1]]], [1, [[2, 3]]], [1, [[0, 1]]]]}
    assert costs.simulate_trace(record, 2, 4) == (dev, host)


# ---- plans of real models --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen():
    return model_shape(load_model_spec("Qwen3-30B-A3B"))


def test_plan_json_has_the_issue_fields(qwen):
    p = plan(qwen, load_profile("rtx4070-12gb"), PlanOptions(vram=10 << 30, ram=24 << 30, context=8192))
    j = plan_json(p, what_ifs(p))
    for key in ("params_total", "params_active", "bytes_total", "placement", "memory", "predicted_tok_s",
                "bottleneck", "what_ifs", "assumptions", "params_active_by_convention", "fit"):
        assert key in j
    assert j["params_active_convention"] == "with_embedding_and_head"
    assert j["params_active_by_convention"]["with_embedding_and_head"] == j["params_active"] == 3_353_032_704
    t = j["predicted_tok_s"]
    assert 0 < t["no_hits"] <= t["expected"] <= t["all_hits"]
    mem = j["memory"]["device"]
    assert mem["budget_charged"] <= 10 << 30 and mem["kv_cache"] == 8192 * 2 * 4 * 128 * 48 * 2
    assert {"weights", "staging", "kv_cache", "activations", "reserve"} <= set(mem)
    assert j["placement"]["summary"]["expert"]["home"] == "disk"  # 57 GB of bf16 weights, 24 GiB of RAM
    text = plan_text(p, what_ifs(p))
    assert "placement" in text and "memory per tier" in text and "what-ifs" in text


def test_weights_scale_bytes(qwen):
    """--weights int4 / fp8 are the units of tools/make_checkpoint.py --quant ct-int4 / fp8-block (issue 28 item
    6, tests/test_plan_formats.py): linear weights at 4 + 16/32 bits (bf16 scales per 32, as the releases store
    them) and 8 + 32/128^2 bits, the embedding, the head and the routers kept in bf16."""
    from offload_engine.checkpoint.naming import UnitKey

    bf16 = plan(qwen, GPU, PlanOptions(weights="bf16"))
    int4 = plan(qwen, GPU, PlanOptions(weights="int4"))
    fp8 = plan(qwen, GPU, PlanOptions(weights="fp8"))
    expert, embed = UnitKey(0, "expert", 0), UnitKey(-1, "embed")
    assert int4.unit_bytes[expert] / bf16.unit_bytes[expert] == pytest.approx(4.5 / 16, rel=0.01)
    assert fp8.unit_bytes[expert] / bf16.unit_bytes[expert] == pytest.approx(0.5, rel=0.01)
    assert int4.unit_bytes[embed] == fp8.unit_bytes[embed] == bf16.unit_bytes[embed]
    assert int4.bytes_total / bf16.bytes_total == pytest.approx(0.2962, rel=0.01)  # 2% of the weights stay bf16
    assert fp8.bytes_total / bf16.bytes_total == pytest.approx(0.5106, rel=0.01)
    assert int4.expected > bf16.expected


def test_native_formats_of_quantized_releases():
    ds = WeightFormat.of(load_model_spec("DeepSeek-V3"), None)
    assert ds.expert_bits == pytest.approx(8, abs=0.01) and ds.embed_bits == 16
    oss = WeightFormat.of(load_model_spec("gpt-oss-120b"), None)
    assert oss.expert_bits == 4.25 and oss.dense_bits == 16


def test_speculation_reports_acceptance_and_union():
    shape = model_shape(load_model_spec("DeepSeek-V3"))
    p = plan(shape, load_profile("rtx4090-24gb"), PlanOptions(weights="int4", spec="mtp"))
    assert p.use_mtp and p.spec_info["accepted_per_step"] == pytest.approx(1.85)
    union = p.spec_info["expert_union_per_layer"]
    assert union[0] == pytest.approx(8) and 8 < union[1] < 16
    with pytest.raises(ConfigError, match="no multi-token-prediction"):
        plan(model_shape(load_model_spec("Llama-3.1-70B")), GPU, PlanOptions(spec="mtp"))


def test_what_ifs_find_a_doubling(qwen):
    p = plan(qwen, load_profile("rtx4070-12gb"), PlanOptions(vram=10 << 30, ram=24 << 30))
    ifs = what_ifs(p)
    assert any(w.factor and w.factor >= 2 for w in ifs)
    assert any(w.change.startswith("--ram") for w in ifs) and any(w.change.startswith("--weights int4") for w in ifs)


def test_memory_table_adds_up(qwen):
    p = plan(qwen, CPU, PlanOptions(ram=20 << 30, context=1024))
    host = memory_table(p)["host"]
    parts = host["weights"] + host["staging"] + host["kv_cache"] + host["row_cache"]
    assert host["budget_charged"] == parts <= 20 << 30
    assert host["total"] == host["budget_charged"] + host["activations"] + host["reserve"]


# ---- hardware profiles -------------------------------------------------------------------------------------------
def test_shipped_profiles_load():
    names = list_profiles()
    assert {"rtx4070-12gb", "rtx4090-24gb", "v100-16gb-pcie3", "h200-host"} <= set(names)
    for name in names:
        prof = load_profile(name)
        assert prof.sources and prof.nvme_gbps > 0
    assert load_profile("RTX4090-24GB").vram_bytes == 24 << 30


def test_profile_errors():
    with pytest.raises(ConfigError, match="rtx4070-12gb"):
        load_profile("no-such-card")
    data = json.loads((HARDWARE_DIR / "rtx4090-24gb.json").read_text())
    with pytest.raises(ConfigError, match="unknown field"):
        HardwareProfile.from_dict({**data, "bogus": 1})
    with pytest.raises(ConfigError, match="missing"):
        HardwareProfile.from_dict({k: v for k, v in data.items() if k != "nvme_gbps"})


def test_probe_writes_a_loadable_profile(tmp_path):
    prof = probe(tmp_path, name="here", read_bytes=16 << 20, quick=True)
    assert prof.nvme_gbps > 0 and prof.cpu_gemv_gbps > 0 and prof.ram_gbps > 0 and prof.ram_bytes > 0
    path = save_profile(prof, tmp_path / "here.json")
    assert load_profile(path) == prof.with_changes(vram_bytes=prof.vram_bytes)
    assert not list(tmp_path.glob(".offload-engine-probe-*"))  # scratch file removed


# ---- commands ------------------------------------------------------------------------------------------------
def run_tool(*argv, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    code = tool.main(list(argv))
    return code, capsys.readouterr()


def test_tool_plan_json(capsys):
    code, out = run_tool("--model", "Mixtral-8x7B", "--hardware", "rtx4090-24gb", "--weights", "int4", "--json",
                         capsys=capsys)
    assert code == 0
    j = json.loads(out.out)
    assert j["params_total"] == pytest.approx(46.7e9, rel=0.01) and set(j["predicted_tok_s"]) == {
        "no_hits", "expected", "all_hits"}


def test_tool_exit_codes(capsys):
    code, out = run_tool("--model", "no-such-model", capsys=capsys)
    assert code == 2 and "names:" in out.err
    code, out = run_tool("--model", "Qwen3-30B-A3B", "--hardware", "rtx4070-12gb", "--vram", "100MiB",
                         capsys=capsys)
    assert code == 3 and "device budget too small" in out.err


def test_calibrate_against_a_bench_json(checkpoint_factory):
    model = checkpoint_factory("qwen3_moe", "offload")
    bench = {"model": {"path": str(model)}, "settings": {"prompt_len": 8, "tokens": 8},
             "resident": {"tok_s": 50.0, "hit_rate": 1.0},
             "rows": [{"budget_pct": 100, "engine": {"decode_tok_s": 40.0, "hit_rate": 1.0}},
                      {"budget_pct": 25, "engine": {"tok_s": 10.0, "hit_rate": 0.3}}]}
    rows, table = calibrate(bench, None, CPU)
    assert [r["budget_pct"] for r in rows] == [None, 100, 25]
    # fewer hits: more bytes from disk, never faster (here the reads hide behind the other experts' dispatch costs)
    assert rows[2]["disk_mb_predicted"] > rows[1]["disk_mb_predicted"]
    assert rows[2]["predicted_tok_s"] <= rows[1]["predicted_tok_s"]
    assert 0 <= rows[2]["expert_hit_rate"] <= 1 and "resident" in table and "25%" in table


def test_calibrate_tool_runs_the_engine_and_compares(checkpoint_factory, tmp_path, capsys):
    import importlib.util

    model = checkpoint_factory("qwen3_moe", "offload")
    prof = save_profile(CPU, tmp_path / "cpu.json")
    spec = importlib.util.spec_from_file_location("calibrate_tool", ROOT / "tools" / "calibrate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "calibration.json"
    code = tool.main(["--model", str(model), "--hardware", str(prof), "--budgets", "100,30", "--tokens", "2",
                      "--json", str(out), "--markdown", "--work-dir", str(tmp_path)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["budget_pct"] for r in result["rows"]] == [100, 30] and result["tier"] == "ram"
    for row, run in zip(result["rows"], result["engine"]):
        assert run["direct_io"] and run["decode_steps"] == 2 and row["measured_tok_s"] == run["tok_s"]
        assert row["ratio"] == pytest.approx(row["predicted_tok_s"] / row["measured_tok_s"])
        assert row["within_25pct"] == (abs(row["ratio"] - 1) <= 0.25)
    assert "| 30% |" in capsys.readouterr().out


def test_scale_table_row():
    rows = scale_rows(["Mixtral-8x7B"], ["rtx4070-12gb"], ["int4"])
    assert rows[0]["tok_s"]["expected"] > 0
    assert "| Mixtral-8x7B | rtx4070-12gb | int4 |" in scale_markdown(rows)


def test_large_slots_are_whole_pages_and_start_pages_in_a_host_region():
    """Slots of 1 MiB and more are rounded to whole pages, so in a page-aligned region every slot starts a page
    (weight rows straddling pages are slower to stream); smaller ones only to 64 bytes (tiny units stay tiny)."""
    import mmap

    from offload_engine.checkpoint.naming import UnitKey
    from offload_engine.planner.placement import PAGE, kind_sizes
    from offload_engine.store.hostmem import host_buffer

    sizes = kind_sizes({UnitKey(0, "expert", 0): (3 << 20) + 100, UnitKey(0, "dense"): 1000})
    assert sizes["expert"].slot_bytes == (3 << 20) + PAGE
    assert sizes["dense"].slot_bytes == 1024
    if hasattr(mmap, "MADV_HUGEPAGE"):  # where host regions are page-aligned (Linux)
        slots = host_buffer(4 * sizes["expert"].slot_bytes).split(sizes["expert"].slot_bytes)
        assert all(s.data_ptr() % PAGE == 0 for s in slots)
