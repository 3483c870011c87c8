"""Prefetch never changes what is computed: any depth, on or off, random read delays -> identical tokens."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from offload_engine import Budget, Engine, PrefetchConfig
from offload_engine.prefetch.predictor import Combined, FrequencyPrior
from offload_engine.checkpoint.naming import UnitKey
from offload_engine.store.disk import read_range

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


class RandomDelays:
    def __init__(self, seed: int):
        self.rng, self.lock = random.Random(seed), threading.Lock()

    def __call__(self, files, r, blob):
        with self.lock:
            delay = self.rng.choice([0, 0, 0.001, 0.003])
        time.sleep(delay)
        read_range(files, r, blob)


@pytest.fixture(scope="module")
def reference(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, max_context=64) as engine:
        return path, engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True).token_ids


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("ram,vram", [("25%", None), ("10%", None), ("40%", "10%")])
def test_prefetch_depths_and_delays_match_resident(reference, depth, ram, vram):
    path, expected = reference
    config = PrefetchConfig(depth=depth, adaptive=False)
    with Engine.open(path, budget=Budget(ram=ram, vram=vram), max_context=64, prefetch=config,
                     direct_io="off", read_fn=RandomDelays(depth)) as engine:
        completion = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert completion.token_ids == expected
    stats = completion.stats
    assert stats["prefetch"]["enabled"] and stats["prefetch_issued"] > 0
    assert 0.0 <= stats["prefetch"]["recall"] <= 1.0


def test_prefetch_off_matches(reference):
    path, expected = reference
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, prefetch=False) as engine:
        completion = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert completion.token_ids == expected
    assert completion.stats["prefetch_issued"] == 0


def test_frequency_prior_and_combination():
    prior = FrequencyPrior([0, 1], top_k=2)
    for experts in ([1, 2], [1, 3], [1, 2]):
        prior.observe(1, experts)
    ranked = prior.predict(0, torch.zeros(1, 4), horizon=1)
    assert ranked[0] == (UnitKey(1, "expert", 1), 1.0)
    assert {k.expert for k, _ in ranked} == {1, 2, 3}

    class Fixed:
        def predict(self, layer, hidden, horizon):
            return [(UnitKey(1, "expert", 3), 0.5)]

        def observe(self, layer, experts):
            pass

    combined = dict(Combined(prior, Fixed()).predict(0, torch.zeros(1, 4), 1))
    assert combined[UnitKey(1, "expert", 3)] == pytest.approx(1 - (1 - 1 / 3) * 0.5)
