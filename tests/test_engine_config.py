"""EngineConfig: every Engine.open option in one frozen dataclass, validated when built (before any checkpoint is
opened), taken by Engine.open as is or built from its keywords; the CLI's flags offer exactly the modes the
config accepts; the engine's parts get what they need from the assembly (prefetcher, host compute, routing
trace), and the engine's stats come from the parts' snapshots."""
from __future__ import annotations

import argparse

import pytest

from offload_engine import Budget, Engine, EngineConfig, PrefetchConfig, SpeculativeConfig
from offload_engine.cli import build_parser
from offload_engine.errors import ConfigError
from offload_engine.modes import DIRECT_IO_MODES, HOST_COMPUTE_MODES, PLAN_SPEC_MODES, SPEC_MODES
from offload_engine.modes import POLICIES

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.mark.parametrize("options, flag", [
    ({"policy": "fifo"}, "--policy"), ({"direct_io": "sometimes"}, "--direct-io"),
    ({"host_compute": "gpu"}, "--host-compute"), ({"prefill_chunk": 0}, "--prefill-chunk"),
    ({"dtype": "int3"}, "--dtype"), ({"device": "tpu"}, "--device"),
    ({"speculative": "ngram"}, "speculative must be"), ({"budget": "25%"}, "budget must be"),
])
def test_a_bad_option_is_refused_by_name_when_the_config_is_built(options, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineConfig(**options)


def test_speculative_options_are_checked_together():
    with pytest.raises(ConfigError, match="--spec must be one of"):
        SpeculativeConfig("medusa")
    with pytest.raises(ConfigError, match="needs a draft model"):
        SpeculativeConfig("draft")
    with pytest.raises(ConfigError, match="--spec-width must be an integer from 1 to 4"):
        SpeculativeConfig("ngram", width=5)
    assert SpeculativeConfig("draft", draft_model="x").draft_budget is None


def test_from_dict_rejects_unknown_keys_also_nested():
    config = EngineConfig.from_dict({"budget": {"ram": "25%"}, "speculative": {"mode": "ngram", "depth": 2},
                                     "prefetch": {"depth": 2}, "max_context": 64})
    assert config == EngineConfig(budget=Budget(ram="25%"), speculative=SpeculativeConfig("ngram", 2),
                                  prefetch=PrefetchConfig(depth=2), max_context=64)
    for data, name in (({"contxt": 64}, "EngineConfig"), ({"budget": {"vrma": "1GiB"}}, "Budget"),
                       ({"speculative": {"mode": "off", "wdth": 1}}, "SpeculativeConfig"),
                       ({"prefetch": {"depht": 1}}, "PrefetchConfig")):
        with pytest.raises(ConfigError, match=f"{name}: unknown option"):
            EngineConfig.from_dict(data)


def test_prefetch_is_kept_as_a_prefetch_config():
    assert EngineConfig(prefetch=False).prefetch == PrefetchConfig(enabled=False)
    assert EngineConfig().prefetch == PrefetchConfig()


def test_the_keyword_form_is_the_same_config():
    keywords = EngineConfig.from_keywords(budget=Budget(ram="25%"), max_context=64, spec="ngram", spec_depth=2,
                                          policy="lru", prefill_chunk=8)
    assert keywords == EngineConfig(budget=Budget(ram="25%"), max_context=64, policy="lru", prefill_chunk=8,
                                    speculative=SpeculativeConfig("ngram", depth=2))
    with pytest.raises(TypeError):
        EngineConfig.from_keywords(contxt=64)


def test_open_takes_a_config_or_keywords_with_the_same_result(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, spec="ngram") as engine:
        by_keywords = engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True).token_ids
    config = EngineConfig(budget=Budget(ram="25%"), max_context=64, speculative=SpeculativeConfig("ngram"))
    with Engine.open(path, config) as engine:
        assert engine.speculative == config.speculative
        assert engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True).token_ids == by_keywords
    with pytest.raises(TypeError, match="not both"):
        Engine.open(path, config, max_context=32)


def _choices(parser: argparse.ArgumentParser, command: str, flag: str) -> tuple:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return tuple(next(a for a in sub._actions if flag in a.option_strings).choices)


def test_the_flags_offer_the_modes_the_config_accepts():
    parser = build_parser()
    assert _choices(parser, "run", "--spec") == SPEC_MODES
    assert _choices(parser, "run", "--policy") == POLICIES
    assert _choices(parser, "run", "--host-compute") == HOST_COMPUTE_MODES
    assert _choices(parser, "run", "--direct-io") == DIRECT_IO_MODES
    assert _choices(parser, "plan", "--spec") == PLAN_SPEC_MODES
    assert _choices(parser, "plan", "--direct-io") == DIRECT_IO_MODES
    assert set(PLAN_SPEC_MODES) <= set(SPEC_MODES)


def test_the_parts_come_from_the_assembly_and_stats_from_their_snapshots(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, record_routing=True) as engine:
        model = engine.model
        assert model.prefetcher is not None  # weights stream at 25%: handed to the model when it was built
        assert model.host_compute is None  # host_compute="off"
        before = engine.snapshot()
        completion = engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
        after = engine.snapshot()
        assert model.routing_trace and {layer for layer, _ in model.routing_trace} <= set(range(model.num_layers))
    stats = completion.stats
    assert stats["bytes_read_disk"] == after["bytes_read_disk"] - before["bytes_read_disk"]
    assert stats["host_compute_s"] == after["host_compute_s"] - before["host_compute_s"]
    assert stats["peak_bytes"]["host"] == after["peak_bytes"]["host"] <= after["budget_bytes"]["host"]
    tier = engine.compute_tier
    looked = after["hits"][tier] + after["misses"][tier] - before["hits"][tier] - before["misses"][tier]
    assert stats["hit_rate"] == pytest.approx((after["hits"][tier] - before["hits"][tier]) / looked)


def test_the_cpu_default_dtype_follows_a_bf16_checkpoint(checkpoint_factory):
    """On a CPU the compute dtype defaults to the checkpoint's where it is bfloat16 and the CPU multiplies it
    natively (runtime/devices.py resolve_dtype), float32 otherwise (stats name it, "dtype"); an explicit dtype wins."""
    import torch

    from offload_engine.runtime.devices import cpu_computes_bf16, resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu, "float32") == torch.float32
    assert resolve_dtype(None, cpu, "bfloat16") == (torch.bfloat16 if cpu_computes_bf16() else torch.float32)
    assert resolve_dtype("float32", cpu, "bfloat16") == torch.float32
    path = checkpoint_factory("llama", dtype="bfloat16")
    with Engine.open(path, device="cpu") as engine:
        assert str(engine.dtype).replace("torch.", "") == ("bfloat16" if cpu_computes_bf16() else "float32")
    with Engine.open(path, device="cpu", dtype="float32") as engine:
        assert str(engine.dtype).replace("torch.", "") == "float32"
