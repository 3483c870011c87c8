"""Long prompts run `prefill_chunk` tokens at a time (CausalLM.forward): the same logits and tokens as
transformers' one forward, the cache rewound when a chunk fails. The chunk is made small here so short prompts
span several."""
from __future__ import annotations

import json

import pytest
import torch

from offload_engine import Budget, Engine
from offload_engine.errors import ConfigError

from conftest import ARCHS
from test_parity import PROMPT_LEN, check_parity

CHUNK = 24  # PROMPT_LEN 64 -> chunks of 24, 24, 16


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prompt_matches_transformers(checkpoint_factory, arch):
    assert PROMPT_LEN > 2 * CHUNK
    check_parity(checkpoint_factory(arch), prefill_chunk=CHUNK)


def test_chunked_rows_and_hidden_are_the_single_forwards(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    ids = torch.arange(3, 3 + PROMPT_LEN)
    with Engine.open(path, budget=Budget(ram="25%"), max_context=128, prefill_chunk=CHUNK) as engine:
        model = engine.model
        model.prefill_chunk = PROMPT_LEN
        whole = model.forward(ids, model.new_cache(PROMPT_LEN), return_hidden=True)
        model.prefill_chunk = CHUNK
        for last_only in (False, True):
            cache = model.new_cache(PROMPT_LEN)
            logits, hidden = model.forward(ids, cache, last_only=last_only, return_hidden=True)
            rows = slice(-1, None) if last_only else slice(None)
            assert logits.shape == whole[0][rows].shape and hidden.shape == whole[1][rows].shape
            torch.testing.assert_close(logits, whole[0][rows], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(hidden, whole[1][rows], rtol=1e-4, atol=1e-4)
            assert cache.length == PROMPT_LEN


def test_a_failing_chunk_leaves_the_cache_as_it_was(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("qwen3_moe")
    with Engine.open(path, max_context=128, prefill_chunk=CHUNK) as engine:
        model = engine.model
        cache = model.new_cache(PROMPT_LEN + 8)
        model.forward(torch.tensor([5, 6, 7]), cache)  # a committed start the failure must not lose
        real, calls = model.forward_once, []

        def second_chunk_fails(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected fault in the second chunk")
            return real(*args, **kwargs)

        monkeypatch.setattr(model, "forward_once", second_chunk_fails)
        with pytest.raises(RuntimeError, match="second chunk"):
            model.forward(torch.arange(10, 10 + PROMPT_LEN), cache)
        assert cache.length == 3
        monkeypatch.setattr(model, "forward_once", real)
        completion = engine.generate([5, 6, 7], max_new_tokens=4, ignore_eos=True)  # usable again
        assert len(completion.token_ids) == 4


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "512"])
def test_a_bad_prefill_chunk_is_refused_by_name(checkpoint_factory, bad):
    with pytest.raises(ConfigError, match="--prefill-chunk"):
        Engine.open(checkpoint_factory("qwen3_moe"), prefill_chunk=bad)


def test_cli_and_plan_take_the_chunk(checkpoint_factory, capsys):
    from offload_engine.cli import main

    path = checkpoint_factory("qwen3_moe")
    assert main(["run", "--model", str(path), "--prompt", "x" * 40, "--prefill-chunk", "2", "--max-new-tokens", "2",
                 "--json", "--quiet"]) == 0
    capsys.readouterr()
    act = {}
    for chunk in (64, 512):
        assert main(["plan", "--model", str(path), "--context", "512", "--prefill-chunk", str(chunk), "--json"]) == 0
        act[chunk] = json.loads(capsys.readouterr().out)["memory"]
    assert act[64] != act[512]
    assert main(["plan", "--model", str(path), "--prefill-chunk", "0"]) != 0
