"""The prompt cache (generate/prompt_cache.py, `serve --cache-ram`): KV snapshots of recent sequences in a byte
limit, the longest cached prefix of a prompt reused. Each reusing request is checked against a cold engine (no
reuse at all: every prompt prefilled from scratch) for the same greedy tokens, on the demo model (MLA attention;
its cache stored as given and as int8 with scales) and on a tiny hybrid (Gated DeltaNet + attention) checkpoint.
Expected reuse is the token-level common prefix of the cached sequence (prompt + generated ids but the last) and
the new prompt, computed here from the cold engine's outputs."""
from __future__ import annotations

import json
import re

import pytest
import torch

try:
    import httpx2 as httpx  # the openai client's HTTP library where it is httpx's successor
except ImportError:
    import httpx

from offload_engine import ConfigError, Engine
from offload_engine.cli import build_parser, main
from offload_engine.frontend.engine_flags import engine_config
from offload_engine.config import Budget, EngineConfig
from offload_engine.defaults import default_model_path
from offload_engine.planner import kv
from offload_engine.server.app import ServerSettings
from tests.serving import serving

DEMO = default_model_path()
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def cold_engine(path=DEMO, **options) -> Engine:
    engine = Engine.open(path, **options)
    engine.reuse_prefix = False  # nothing reused: the reference
    return engine


def held(prompt: list[int], generated: list[int]) -> list[int]:
    """What a finished request's cache holds: the prompt and every generated id but the last (never forwarded)."""
    return prompt + generated[:-1]


def shared(a: list[int], b: list[int]) -> int:
    """Positions of `a` a prompt `b` may reuse: their common prefix, less b's last token (always forwarded)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(n, len(b) - 1)


def metric(text: str, name: str) -> int:
    found = re.search(rf"^{re.escape(name)} (\d+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return int(found.group(1))


def test_interleaved_conversations_both_reuse_through_the_server():
    """A, B, A continued, B continued over HTTP: each continuation reuses its own history from a saved snapshot
    (cached_tokens says how much), answers equal a cold prefill's, and /metrics counts the entries and hits."""
    with Engine.open(DEMO, cache_ram="1MiB") as engine, cold_engine() as cold, \
            serving(engine, ServerSettings(model_id="demo-model")) as url:
        chats = {"A": [{"role": "system", "content": "You answer in French."},
                       {"role": "user", "content": "Name a fruit."}],
                 "B": [{"role": "system", "content": "You are a pirate."},
                       {"role": "user", "content": "Where is the treasure?"}]}
        before: dict[str, list[int]] = {}
        cached = {}
        for turn in ("A", "B", "A", "B"):
            messages = chats[turn]
            ids = engine.tokenizer.encode_chat(messages)
            want = cold.generate(ids, max_new_tokens=6, temperature=0)
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": "demo-model", "messages": messages, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"] == want.text
            cached[turn] = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            if turn in before:  # the continuation: its own history, not the other conversation's
                assert cached[turn] == shared(before[turn], ids) > len(before[turn]) // 2
            before[turn] = held(ids, want.token_ids)
            messages += [{"role": "assistant", "content": want.text}, {"role": "user", "content": "And then?"}]
        text = httpx.get(url + "/metrics").text
        assert metric(text, 'offload_engine_prompt_cache_hits_total{source="saved"}') == 2
        assert metric(text, 'offload_engine_prompt_cache_tokens_reused_total{source="saved"}') == cached["A"] + cached["B"]
        assert metric(text, "offload_engine_prompt_cache_entries") == len(engine.prompt_cache.entries) == 2
        assert metric(text, "offload_engine_prompt_cache_bytes") == sum(e.nbytes for e in engine.prompt_cache.entries)
        assert metric(text, "offload_engine_prompt_cache_limit_bytes") == 1 << 20


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_shared_system_prompt_is_reused_by_a_third_request(kv_dtype):
    """A and C share a system prompt, B between them does not: C reuses A's saved prefix (a copy loaded into the
    live cache), so the system prompt is prefilled once; a quantized cache is copied with its scales. C's
    continuation never writes into A's entry."""
    system = {"role": "system", "content": "You are a careful assistant. Answer in one short sentence, no lists."}
    prompts = [[system, {"role": "user", "content": "What is rain?"}],
               [{"role": "system", "content": "Reply in Latin."}, {"role": "user", "content": "Salve"}],
               [system, {"role": "user", "content": "Why is the sky blue?"}]]
    with Engine.open(DEMO, cache_ram="1MiB", kv_dtype=kv_dtype) as engine, cold_engine(kv_dtype=kv_dtype) as cold:
        ids = [engine.tokenizer.encode_chat(m) for m in prompts]
        got = [engine.generate(i, **GREEDY) for i in ids]
        for g, i in zip(got, ids):
            assert g.token_ids == cold.generate(i, **GREEDY).token_ids
        system_tokens = shared(ids[0], ids[2])
        assert system_tokens > 15
        assert got[2].stats["reused_prompt_tokens"] == system_tokens
        assert got[2].stats["prefilled_tokens"] == len(ids[2]) - system_tokens
        assert engine.prompt_cache.snapshot()["hits"]["saved"] == 1
        # A's entry is untouched by C, which continued from a copy of its prefix: A again reuses all of it
        again = engine.generate(ids[0], **GREEDY)
        assert again.stats["reused_prompt_tokens"] == len(ids[0]) - 1 and again.token_ids == got[0].token_ids


def test_entries_are_truncated_copies_evicted_by_their_measured_bytes():
    """A limit of 60 positions' bytes holds two 24-position entries: the least recently used one goes. Each entry's
    bytes, measured from its tensors, are the planner's per-position bytes times its length (a copy truncated to
    its sequence, not the engine's whole context)."""
    with Engine.open(DEMO, max_context=256) as probe:
        per = kv.kv_bytes_per_position(probe.model.spec, torch.empty((), dtype=probe.dtype).element_size())
    prompts = {name: [start + j for j in range(20)] for name, start in (("A", 40), ("B", 90), ("C", 140))}
    with Engine.open(DEMO, max_context=256, cache_ram=60 * per) as engine, cold_engine(max_context=256) as cold:
        cache = engine.prompt_cache
        reused = {}
        for step, name in enumerate(["A", "B", "C", "A", "B"]):
            got = engine.generate(prompts[name], **GREEDY)
            assert got.token_ids == cold.generate(prompts[name], **GREEDY).token_ids
            reused[step] = got.stats["reused_prompt_tokens"]
            assert cache.nbytes <= 60 * per
            for entry in cache.entries:
                assert entry.cache.capacity == entry.cache.length == len(entry.ids) == 20 + 6 - 1
                assert entry.nbytes == len(entry.ids) * per
            assert cache.nbytes == sum(e.nbytes for e in cache.entries)
        # A again found its entry (B's was the least recently used when C's came in); B again found none
        assert reused == {0: 0, 1: 0, 2: 0, 3: 19, 4: 0}
        assert cache.evictions >= 1 and len(cache.entries) == 2


def test_cache_ram_0_keeps_only_the_last_sequence():
    with Engine.open(DEMO, cache_ram=0) as engine:
        assert all(t.prompt_cache_bytes == 0 for t in engine.placement.tiers)
        a, b = [5 + j for j in range(12)], [60 + j for j in range(12)]
        engine.generate(a, **GREEDY)
        engine.generate(b, **GREEDY)
        assert engine.generate(a, **GREEDY).stats["reused_prompt_tokens"] == 0
        assert engine.prompt_cache.snapshot()["entries"] == 0
    assert engine_config(build_parser().parse_args(["serve", "--cache-ram", "0"])).cache_ram == "0"


@pytest.mark.parametrize("value", ["lots", "-1GiB", "2 parsecs"])
def test_a_bad_cache_ram_names_the_flag(value, capsys):
    with pytest.raises(ConfigError, match="--cache-ram"):
        EngineConfig(cache_ram=value)
    assert main(["serve", f"--cache-ram={value}", "--port", "0"]) == 2  # refused before anything loads
    assert "--cache-ram" in capsys.readouterr().err
    assert main(["plan", "--model", str(DEMO), f"--cache-ram={value}"]) == 2
    assert "--cache-ram" in capsys.readouterr().err


def test_the_budget_charges_it_and_plan_shows_it(capsys):
    """--cache-ram is charged to the host tier, as plan predicts: fewer expert slots under the same --ram."""
    ram = "20MiB"
    with Engine.open(DEMO, budget=Budget(ram=ram)) as plain, \
            Engine.open(DEMO, budget=Budget(ram=ram), cache_ram="2MiB") as cached:
        host = cached.placement.tiers[-1]
        assert host.prompt_cache_bytes == cached.prompt_cache.limit == 2 << 20
        assert cached.placement.compute.slots["expert"] < plain.placement.compute.slots["expert"]
        assert "prompt cache" in cached.placement.describe()
    planned = {}
    for cache_ram in ("0", "2MiB"):
        assert main(["plan", "--model", str(DEMO), "--ram", ram, "--cache-ram", cache_ram, "--json"]) == 0
        planned[cache_ram] = json.loads(capsys.readouterr().out)
    assert planned["2MiB"]["memory"]["host"]["prompt_cache"] == 2 << 20
    assert planned["0"]["memory"]["host"]["prompt_cache"] == 0
    assert (planned["2MiB"]["memory"]["host"]["weights"] < planned["0"]["memory"]["host"]["weights"])
    assert main(["plan", "--model", str(DEMO), "--ram", ram, "--cache-ram", "2MiB"]) == 0
    assert re.search(r"prompt cache \(--cache-ram\)\s+2\.00 MiB", capsys.readouterr().out)
    # auto (serve's default): 1/32 of the host budget, at most 1 GiB
    assert kv.prompt_cache_bytes("auto", 8 << 30, 1) == 256 << 20
    assert kv.prompt_cache_bytes("auto", None, 1) == kv.prompt_cache_bytes("auto", 64 << 30, 1) == 1 << 30
    assert build_parser().parse_args(["serve"]).cache_ram == "auto"


def test_hybrid_model_reuses_a_shared_prefix_and_its_saved_states(checkpoint_factory):
    """Gated DeltaNet layers rewind only a few positions: the second request sharing a prefix forwards it on its
    own and saves it there, so the third reuses it; a saved sequence is reused where its state can be rewound to."""
    path = checkpoint_factory("qwen3_next")
    system = list(range(3, 40))
    with Engine.open(path, cache_ram="8MiB") as engine, cold_engine(path) as cold:
        reused = []
        for question in ([50, 51, 52, 53], [60, 61, 62], [70, 71, 72, 73, 74], [50, 51, 52, 53, 9]):
            ids = system + question
            got = engine.generate(ids, **GREEDY)
            assert got.token_ids == cold.generate(ids, **GREEDY).token_ids
            reused.append(got.stats["reused_prompt_tokens"])
            if len(reused) == 2:  # the system prompt's state, saved where the second request diverged
                assert len(system) in {len(e.ids) for e in engine.prompt_cache.entries}
        # the first shared nothing; the second forwarded and saved the system prompt; the third reused it; the fourth
        # extends the first request's prompt, whose saved state is there (its prefill's end)
        assert reused == [0, 0, len(system), len(system) + 4]
