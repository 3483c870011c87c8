"""A run given no --ram on a CPU fits what the machine has (issue 50: a 32 GB checkpoint on a 23 GiB machine must
stream, not be pinned whole): store.build.fitted_host_budget, and Engine.open on a machine that has less memory
available than the model needs (the OS's figure is replaced, not the engine's rule)."""
from __future__ import annotations

import pytest

from offload_engine import Engine
from offload_engine.errors import ConfigError
from offload_engine.store import build

GiB = 1 << 30


def test_a_model_that_fits_stays_unbounded():
    assert build.fitted_host_budget(10 * GiB, 20 * GiB) is None


def test_a_model_that_does_not_fit_gets_what_is_available_less_the_reserve():
    assert build.fitted_host_budget(32 * GiB, 22 * GiB) == 22 * GiB - 22 * GiB // 20
    assert build.fitted_host_budget(3 * GiB, 2 * GiB) == 1 * GiB  # the 1 GiB floor of the reserve


def test_no_memory_at_all_is_a_clear_error():
    with pytest.raises(ConfigError, match="give --ram"):
        build.fitted_host_budget(3 * GiB, GiB // 2)


def test_engine_open_without_a_budget_streams_where_the_model_does_not_fit(checkpoint_factory, monkeypatch):
    model = checkpoint_factory("qwen3_moe", "medium")
    with Engine.open(model, max_context=64) as engine:
        pinned_peak = engine.snapshot()["budget_bytes"]
        whole = engine.generate([1, 2, 3, 4], max_new_tokens=6, ignore_eos=True)
    assert pinned_peak.get("host") is None  # fits: unbounded, everything pinned, as before
    need = sum(size.slot_bytes * size.count for size in engine.placement.sizes.values())
    monkeypatch.setattr(build, "available_memory", lambda: need // 2 + build.FIT_RESERVE)
    with Engine.open(model, max_context=64) as engine:
        budget = engine.snapshot()["budget_bytes"]["host"]
        streamed = engine.generate([1, 2, 3, 4], max_new_tokens=6, ignore_eos=True)
    assert budget == need // 2
    assert streamed.token_ids == whole.token_ids  # streaming changes no token
    assert streamed.stats["hit_rate"] < 1.0
