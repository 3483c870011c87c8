"""Speculative decoding through the public surface: Engine.open(spec=...), per-request overrides, the draft
model as a second engine with its own budget, the stats a request reports, refusals, and the CLI flags."""
from __future__ import annotations

import json

import pytest

from offload_engine import Budget, ConfigError, Engine
from offload_engine.cli import main
from offload_engine.speculative.drafters.self_draft import VIEW, RestrictedRouting

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
NEW = 40


@pytest.fixture(scope="module")
def deepseek(checkpoint_factory):
    return checkpoint_factory("deepseek_v3", "offload", mtp=1)


@pytest.fixture(scope="module")
def reference(deepseek):
    with Engine.open(deepseek, budget=Budget(ram="25%"), max_context=256) as engine:
        return engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids


def test_engine_spec_modes_are_lossless_at_a_quarter_budget(deepseek, reference):
    with Engine.open(deepseek, budget=Budget(ram="25%"), max_context=256, spec="mtp") as engine:
        assert engine.placement.home("mtp") == engine.placement.compute.name  # MTP units pinned first
        for mode in ("auto", "mtp", "ngram", "self", "off"):
            out = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec=mode)
            assert out.token_ids == reference, mode
            stats = out.stats
            assert stats["spec"] == mode
            assert {"mean_accepted", "accept_hist", "target_forwards", "bytes_read_disk_per_token"} <= set(stats)
            assert stats["tokens_per_forward"] >= 1.0
            if mode == "off":
                assert stats["target_forwards"] == NEW and stats["spec_steps"] == 0
        fixed = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="mtp", spec_depth=2,
                                spec_width=1)
        assert fixed.token_ids == reference
        assert fixed.stats["spec_steps"] > 0
        assert len(fixed.stats["accept_hist"]) <= 3  # never more than depth 2 accepted
        assert fixed.stats["peak_bytes"]["host"] <= fixed.stats["budget_bytes"]["host"]


def test_self_drafting_reuses_one_view_without_native_kernels(deepseek, reference):
    """Each spec="self" request's drafter runs the target's one kept view (CausalLM.view), built without the
    native kernels; the tokens stay the plain decode's."""
    with Engine.open(deepseek, budget=Budget(ram="25%"), max_context=256) as engine:
        views = []
        for _ in range(2):
            out = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, spec="self")
            assert out.token_ids == reference and out.stats["spec"] == "self"
            views.append(engine.model.view(VIEW, RestrictedRouting))
        assert views[0] is views[1] and views[0] is not engine.model
        assert views[0].kernels is None and isinstance(views[0].ops, RestrictedRouting)
        with pytest.raises(ValueError, match="one name, one wrapper"):
            engine.model.view(VIEW, lambda ops: ops)


def test_draft_model_is_a_second_engine_with_its_own_budget(deepseek, reference):
    with Engine.open(deepseek, budget=Budget(ram="25%"), max_context=256, spec="draft", draft_model=deepseek,
                     draft_budget=Budget(ram="50%"), spec_depth=3, spec_width=1) as engine:
        assert engine.draft is not None and engine.draft.store is not engine.store
        out = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
        assert out.token_ids == reference
        # the draft is the target itself: every draft accepted (bar the cache's end), and the cost model left
        # alone would not speculate at all, since such a draft costs as much as the target
        assert out.stats["mean_accepted"] > 2.5
        draft = engine.draft
    with pytest.raises(Exception, match="closed"):  # closing the target closed the draft too
        draft.generate(PROMPT, max_new_tokens=2)


def test_refusals(deepseek, checkpoint_factory):
    qwen = checkpoint_factory("qwen3_moe", "tiny")
    with pytest.raises(ConfigError, match="--spec must be one of"):
        Engine.open(qwen, spec="medusa")
    with pytest.raises(ConfigError, match="--spec-depth must be an integer from 1 to 8"):
        Engine.open(qwen, spec="ngram", spec_depth=0)
    with pytest.raises(ConfigError, match="--spec-width"):
        Engine.open(qwen, spec="ngram", spec_width=9)
    with pytest.raises(ConfigError, match="needs a draft model"):
        Engine.open(qwen, spec="draft")
    with pytest.raises(ConfigError, match="no multi-token-prediction layers"):
        Engine.open(qwen, spec="mtp")
    with Engine.open(deepseek, max_context=64) as engine:  # opened without its MTP layers
        with pytest.raises(ConfigError, match="without the checkpoint's MTP layers"):
            engine.stream(PROMPT, spec="mtp")
        with pytest.raises(ConfigError, match="without a draft model"):
            engine.generate(PROMPT, max_new_tokens=2, spec="draft")
        with pytest.raises(ConfigError, match=r"exceed the context this engine reserved in its budget \(64 tokens\)"):
            engine.stream(PROMPT, max_new_tokens=64)
        assert engine.generate(PROMPT, max_new_tokens=2).token_ids  # still usable


def test_cli_spec_flags(deepseek, capsys):
    rc = main(["run", "--model", str(deepseek), "--ram", "25%", "--context", "256", "--prompt", PROMPT,
               "--max-new-tokens", "24", "--spec", "mtp", "--spec-depth", "2", "--json", "--quiet"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["stats"]["spec"] == "mtp" and out["stats"]["target_forwards"] > 0
    rc = main(["run", "--model", str(deepseek), "--context", "256", "--prompt", "x", "--max-new-tokens", "4",
               "--spec", "draft"])
    assert rc == 2 and "needs a draft model" in capsys.readouterr().err
    rc = main(["run", "--model", str(deepseek), "--context", "256", "--prompt", PROMPT, "--max-new-tokens", "16",
               "--spec", "ngram", "--spec-depth", "3", "--stats", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 0 and "spec ngram:" in err and "tokens/forward" in err
