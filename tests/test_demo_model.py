"""The bundled demo model (offload_engine/data/demo-model, trained by tools/train_demo.py): the engine's default,
a complete Hugging Face folder, runnable within a quarter of its size with --spec auto, and its MTP layer
drafts with real acceptance while the output stays identical to plain decoding."""
from __future__ import annotations

import json

import pytest

from offload_engine import Budget, Engine
from offload_engine.cli import main
from offload_engine.defaults import PACKAGE_MODEL, default_model_path

# the opening of a held-out stdlib-style function (train_demo holds out every 20th file)
PROMPT = 'import os\n\n\ndef read_lines(path):\n    """Return the lines of the file at path."""\n'
NEW = 48


def test_bundled_model_is_a_complete_folder_within_the_size_cap():
    assert default_model_path() == PACKAGE_MODEL or default_model_path().name != "demo-model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (PACKAGE_MODEL / name).is_file(), name
    assert sum(f.stat().st_size for f in PACKAGE_MODEL.iterdir()) <= 40 * 1024 * 1024
    config = json.loads((PACKAGE_MODEL / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    assert 8 <= config["n_routed_experts"] <= 32 and config["num_experts_per_tok"] == 2


@pytest.fixture(scope="module")
def engine():
    with Engine.open(PACKAGE_MODEL, budget=Budget(ram="25%"), max_context=256, spec="mtp") as e:
        yield e


def test_mtp_drafts_with_real_acceptance_and_loses_nothing(engine):
    plain = engine.generate(PROMPT, max_new_tokens=NEW, spec="off")
    mtp = engine.generate(PROMPT, max_new_tokens=NEW, spec="mtp", spec_depth=1, spec_width=1)
    assert mtp.token_ids == plain.token_ids
    assert mtp.stats["spec_steps"] > 0
    assert mtp.stats["tokens_per_forward"] > 1.3, mtp.stats  # a trained MTP head, not a random one
    auto = engine.generate(PROMPT, max_new_tokens=NEW, spec="auto")
    assert auto.token_ids == plain.token_ids
    assert auto.stats["peak_bytes"]["host"] <= auto.stats["budget_bytes"]["host"]
    assert auto.stats["bytes_read_disk"] > 0  # a quarter of the model: experts stream from the checkpoint


def test_auto_loads_mtp_layers_only_where_they_cost_little():
    """At a quarter of this model the MTP layer would un-pin dense layers (measured: 0.61x plain decoding's
    speed): auto leaves it out and drafts with n-gram / self; with the whole model in budget it is loaded."""
    with Engine.open(PACKAGE_MODEL, budget=Budget(ram="25%"), max_context=256, spec="auto") as engine:
        assert "mtp" not in engine.placement.sizes
        assert engine.placement.home("dense") == engine.placement.compute.name
    with Engine.open(PACKAGE_MODEL, max_context=256, spec="auto") as engine:
        assert engine.placement.home("mtp") == engine.placement.compute.name


def test_readme_first_command_runs_the_bundled_model(capsys):
    rc = main(["run", "--ram", "25%", "--context", "512", "--spec", "auto", "--max-new-tokens", "16", "--stats", "--quiet",
               "--prompt", PROMPT])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.out.strip()
    for part in ("tok/s", "spec auto", "tokens/forward", "hit rate", "/token", "peak device"):
        assert part in captured.err
