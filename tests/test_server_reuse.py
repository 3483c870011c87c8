"""Multi-turn KV reuse: a prompt that extends the last sequence prefills only its new suffix, and the answers are
token-identical to fresh prefills (attention caches, and the recurrent state of a hybrid model)."""
from __future__ import annotations

from pathlib import Path

import pytest

from offload_engine.api import Engine
from offload_engine.config import Budget

DEMO = Path(__file__).resolve().parents[1] / "offload_engine" / "data" / "demo-model"


def test_session_five_turns_prefill_only_the_new_turn():
    with Engine.open(DEMO) as engine, Engine.open(DEMO) as fresh:
        fresh.reuse_prefix = False
        session = engine.session(system="You are terse.")
        held = 0  # positions the engine's cache holds after a turn: prompt + answer but its last token
        for turn in range(5):
            answer = session.send(f"Question {turn}: what is {turn} + 1?", max_new_tokens=8, temperature=0)
            ids = engine.tokenizer.encode_chat(session.messages[:-1])
            want = fresh.generate(ids, max_new_tokens=8, temperature=0)
            assert answer.token_ids == want.token_ids
            assert answer.stats["prompt_tokens"] == len(ids)
            assert answer.stats["reused_prompt_tokens"] == held
            assert answer.stats["prefilled_tokens"] == len(ids) - held
            assert want.stats["reused_prompt_tokens"] == 0
            held = len(ids) + len(answer.token_ids) - 1


def test_a_prompt_that_does_not_extend_the_last_one_starts_fresh():
    with Engine.open(DEMO) as engine:
        a = engine.generate("def fib(n):", max_new_tokens=6, temperature=0)
        b = engine.generate("class Tree:", max_new_tokens=6, temperature=0)
        again = engine.generate("class Tree:", max_new_tokens=6, temperature=0)
        assert a.stats["reused_prompt_tokens"] == 0
        assert again.token_ids == b.token_ids
        # the same prompt again: all but its last token come from the cache
        assert again.stats["reused_prompt_tokens"] == again.stats["prompt_tokens"] - 1


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_moe"])
def test_token_id_extension_equals_fresh_prefill(checkpoint_factory, arch):
    """Hybrid (linear attention + attention) and MoE checkpoints: three turns extending by token ids."""
    path = checkpoint_factory(arch)
    with Engine.open(path) as engine, Engine.open(path) as fresh:
        fresh.reuse_prefix = False
        ids = [1, 5, 9, 13, 2, 7]
        for turn in range(3):
            got = engine.generate(ids, max_new_tokens=5, temperature=0)
            want = fresh.generate(ids, max_new_tokens=5, temperature=0)
            assert got.token_ids == want.token_ids, f"turn {turn}"
            if turn:
                assert got.stats["reused_prompt_tokens"] > 0
            ids = ids + got.token_ids + [3 + turn, 11, 4]


def test_bytes_read_per_turn_drop_under_a_streaming_budget(checkpoint_factory):
    """With experts streamed from disk, a turn that reuses the history reads fewer bytes than a fresh prefill."""
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(ram="25%"), max_context=128, prefetch=False) as engine, \
            Engine.open(path, budget=Budget(ram="25%"), max_context=128, prefetch=False) as fresh:
        assert engine.placement.streams
        fresh.reuse_prefix = False
        ids = list(range(1, 40))
        reused_bytes = fresh_bytes = 0
        for turn in range(4):
            got = engine.generate(ids, max_new_tokens=4, temperature=0)
            want = fresh.generate(ids, max_new_tokens=4, temperature=0)
            assert got.token_ids == want.token_ids
            if turn:
                reused_bytes += got.stats["bytes_read_disk"]
                fresh_bytes += want.stats["bytes_read_disk"]
            print(f"turn {turn}: prompt {len(ids)} tokens, reused {got.stats['reused_prompt_tokens']}: "
                  f"{got.stats['bytes_read_disk']} bytes read vs {want.stats['bytes_read_disk']} fresh")
            ids = ids + got.token_ids + list(range(50 + turn, 60 + turn))
        assert reused_bytes < fresh_bytes
