"""The planner's layer split over pipeline ranks (planner/split.py), on toy byte sizes, exactly."""
from __future__ import annotations

import pytest

from offload_engine.errors import PlanError
from offload_engine.planner.split import Extras, LayerCost, RankSpec, Tier, layer_costs, split_layers, stage_plan

# four alike layers: 10 bytes read every token, 100 of experts of which a token reads 20, KV 5
LAYERS = [LayerCost(always=10, experts=100, touched=20, largest_dense=10, largest_expert=10, kv=5)] * 4


def rank(name: str, memory: int | None, disk: float = 1.0) -> RankSpec:
    return RankSpec(name, (Tier(memory, 1.0),), disk)


def test_alike_ranks_split_evenly_and_the_hops_count():
    split = split_layers(LAYERS, [rank("a", None), rank("b", None)], hop_bytes=4096, link_bps=1024,
                         link_latency_s=0.5)
    assert split.ranges == [(0, 2), (2, 4)]
    assert [s.step_s for s in split.stages] == [60.0, 60.0]  # (10 + 20) bytes per layer at 1 B/s
    assert split.hop_s == 4.5 and split.token_s == 129.0 and split.tok_s == 1 / 129


def test_a_slower_disk_takes_fewer_layers():
    # b holds 130 bytes: with two layers (KV 10) it keeps 20 dense + 100 of 200 expert bytes, and misses
    # 40 x 100/200 = 20 bytes per token: 20 / 0.25 = 80 s on its slow disk, 40 s at 1 B/s
    fast = split_layers(LAYERS, [rank("a", 400), rank("b", 130, disk=1.0)])
    slow = split_layers(LAYERS, [rank("a", 400), rank("b", 130, disk=0.25)])
    assert fast.ranges == [(0, 2), (2, 4)] and [s.step_s for s in fast.stages] == [60.0, 60.0]
    assert slow.ranges == [(0, 3), (3, 4)] and [s.step_s for s in slow.stages] == [90.0, 30.0]
    assert slow.stages[1].missed == 0 and fast.stages[1].missed == 20.0


def test_more_memory_takes_more_layers_and_budgets_hold():
    alike = split_layers(LAYERS, [rank("a", 130, 0.25), rank("b", 130, 0.25)])
    bigger = split_layers(LAYERS, [rank("a", 400, 0.25), rank("b", 130, 0.25)])
    assert alike.ranges == [(0, 2), (2, 4)] and [s.step_s for s in alike.stages] == [120.0, 120.0]
    assert bigger.ranges == [(0, 3), (3, 4)]
    for split in (alike, bigger):
        for s in split.stages:
            assert s.need <= s.memory and sum(s.held) + s.kv <= s.memory


def test_tiers_fill_fastest_first():
    gpu = RankSpec("gpu", (Tier(100, 10.0), Tier(1000, 1.0)), 0.1)
    s = stage_plan(LAYERS, gpu, 0, 1, True, True)
    # VRAM: KV 5, then the 10 dense bytes and 85 of the 100 expert bytes; RAM the other 15
    assert s.held == [95, 15] and s.missed == 0
    assert s.step_s == pytest.approx((10 + 20 * 85 / 100) / 10 + (20 * 15 / 100) / 1.0)


def test_extras_sit_on_the_end_stages():
    extras = Extras(embed=7, head=3, mtp=11)
    split = split_layers(LAYERS, [rank("a", None), rank("b", None)], extras)
    first, last = split.stages
    assert first.weights == 2 * 110 + 7 and last.weights == 2 * 110 + 3 + 11
    assert last.step_s == 60.0 + 3  # the head is read every token


def test_an_infeasible_split_is_refused_with_numbers():
    with pytest.raises(PlanError) as e:
        split_layers(LAYERS, [rank("a", 400), rank("b", 40)])
    assert "b: memory 40 B, its smallest stage needs 45 B" in str(e.value)
    with pytest.raises(PlanError, match="each rank needs at least one layer"):
        split_layers(LAYERS[:1], [rank("a", None), rank("b", None)])


def test_layer_costs_from_unit_bytes():
    from offload_engine.checkpoint.hf_config import parse_config
    from offload_engine.checkpoint.naming import UnitKey

    spec = parse_config({"model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 16,
                         "intermediate_size": 8, "moe_intermediate_size": 4, "num_experts": 4,
                         "num_experts_per_tok": 2, "max_position_embeddings": 64}, "config.json")
    units = {UnitKey(-1, "embed"): 64, UnitKey(2, "head"): 80, UnitKey(0, "dense"): 30, UnitKey(1, "dense"): 40}
    units.update({UnitKey(l, "expert", e): 10 + e for l in (0, 1) for e in range(4)})
    layers, extras = layer_costs(units, spec, 10, 2)
    assert extras == Extras(embed=64, head=80)
    assert layers[1] == LayerCost(always=40, experts=46, touched=23.0, largest_dense=40, largest_expert=13,
                                  kv=2 * 1 * 4 * 2 * 10)


def test_plan_ranks_splits_a_real_config_and_refuses_what_cannot_fit(capsys):
    from offload_engine.cli import main
    from offload_engine.frontend.split import build_split

    split = build_split("Kimi-K2", "4", "rtx4090-24gb", "int4", rank_ram="126GiB")
    assert [a for a, _ in split.ranges] == [0] + [b for _, b in split.ranges[:-1]] and split.ranges[-1][1] == 61
    assert max(s.step_s for s in split.stages) < 1.1 * min(s.step_s for s in split.stages)  # balanced
    assert all(s.need <= s.memory for s in split.stages)
    assert main(["plan", "--model", "Kimi-K2", "--weights", "int4", "--ranks", "rtx4090-24gb,v100-16gb-pcie3"]) == 0
    assert "predicted" in capsys.readouterr().out
    assert main(["plan", "--model", "Kimi-K2", "--ranks", "2", "--rank-vram", "1GiB", "--rank-ram", "1GiB"]) == 3
    assert "no split of 61 layers over 2 ranks fits" in capsys.readouterr().err
