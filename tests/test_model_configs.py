"""configs/models: the released config.json of each planning model parses, and the parameter counts the planner
derives from it alone match the published figures.

Published figures are rounded by their publishers, and publishers disagree on whether the embedding matrix is
"active" (a token reads one of its rows): Qwen and Mistral count it (3.35 B -> "3.3B", 12.88 B -> "12.9B"),
OpenAI does not (gpt-oss-120b: 5.13 B). `params_active` follows sizes.param_counts (embedding counted); each
row below names its tolerance and, where it differs, the convention that matches.
"""
from __future__ import annotations

import json
from functools import lru_cache

import pytest

from offload_engine.planner.plan import MODELS_DIR, load_model_spec
from offload_engine.planner.plan import model_shape as _model_shape

MODELS = sorted(p.stem for p in MODELS_DIR.glob("*.json"))


@lru_cache(maxsize=None)
def shape_of(name: str):
    return _model_shape(load_model_spec(name))

# name: (published total, tolerance), (published active, tolerance)
PUBLISHED = {
    "Qwen3-30B-A3B": ((30.5e9, 0.01), (3.3e9, 0.02)),  # 3.353 B: Qwen rounds down ("3.3B")
    "Qwen3-235B-A22B": ((235e9, 0.01), (22e9, 0.01)),
    "Mixtral-8x7B": ((46.7e9, 0.01), (12.9e9, 0.01)),
    "DeepSeek-V3": ((671e9, 0.01), (37e9, 0.02)),  # 37.55 B with the embedding, 36.63 B without
    "Kimi-K2": ((1.04e12, 0.015), (32e9, 0.03)),  # 1.026 T / 32.86 B: the published 1.04T is not reproduced
    "Llama-3.1-70B": ((70.6e9, 0.01), (70.6e9, 0.01)),
    "Qwen3-Next-80B-A3B": ((80e9, 0.01), (3.9e9, 0.02)),  # "A3B": 3.88 B with the embedding
    "gpt-oss-120b": ((116.83e9, 0.01), None),  # active checked below in OpenAI's convention
}


@pytest.mark.parametrize("name", MODELS)
def test_config_parses_and_has_a_shape(name):
    shape = shape_of(name)
    spec = shape.spec
    assert spec.num_layers > 0 and spec.hidden_size > 0
    assert shape.params().total > 1e9
    raw = json.loads((MODELS_DIR / f"{name}.json").read_text())
    assert "model_type" in raw and "architectures" in raw  # a released config.json, not a summary


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    shape = shape_of(name)
    counts = shape.params()
    (total, tol_total), active = PUBLISHED[name]
    assert abs(counts.total - total) / total <= tol_total, counts.total
    if active:
        value, tol = active
        assert abs(counts.active - value) / value <= tol, counts.active


def test_qwen3_30b_counts_exactly():
    """Hand count: 48 x (attention 18,878,720 incl. norms + router 262,144 + 128 experts x 4,718,592) + embed +
    head + final norm."""
    counts = shape_of("Qwen3-30B-A3B").params()
    per_layer_fixed = 18_878_720 + 262_144
    embed_head = 2 * 151_936 * 2048 + 2048
    assert counts.total == 48 * (per_layer_fixed + 128 * 4_718_592) + embed_head == 30_532_122_624
    assert counts.active == 48 * (per_layer_fixed + 8 * 4_718_592) + embed_head == 3_353_032_704


def test_gpt_oss_active_in_openai_convention():
    """OpenAI counts the unembedding but not the embedding: 5.13 B active of 116.83 B."""
    shape = shape_of("gpt-oss-120b")
    embed = shape.schema.unit_numel(next(shape.schema.keys("embed")))
    assert abs(shape.params().active - embed - 5.13e9) / 5.13e9 < 0.01
    assert shape.source == "planning-only"


def test_deepseek_v3_mtp_is_the_685b_difference():
    shape = shape_of("DeepSeek-V3")
    mtp = sum(shape.mtp.unit_numel(k) for k in shape.mtp.units) + shape.mtp_shared_params
    assert abs(shape.params().total + mtp - 685e9) / 685e9 < 0.01
    assert shape.params().mtp == 0  # the main-model count excludes it
    assert sum(1 for _ in shape.mtp.keys("expert")) == 256


def test_qwen3_5_counts_text_and_vision():
    shape = shape_of("Qwen3.5-35B-A3B")
    assert shape.spec.num_layers == 40 and shape.experts_per_layer == 256
    assert abs(shape.params().total + shape.extra_params["vision"] - 35e9) / 35e9 < 0.01
    assert abs(shape.params().active - 3.45e9) / 3.45e9 < 0.01  # "A3B"; 2.95 B without the embedding
    assert shape.mtp.units  # mtp_num_hidden_layers: 1


@pytest.mark.parametrize("name,layers,experts,top_k", [
    ("Qwen3-30B-A3B", 48, 128, 8), ("Qwen3-235B-A22B", 94, 128, 8), ("Mixtral-8x7B", 32, 8, 2),
    ("DeepSeek-V3", 61, 256, 8), ("Kimi-K2", 61, 384, 8), ("gpt-oss-120b", 36, 128, 4),
    ("Qwen3-Next-80B-A3B", 48, 512, 10), ("Llama-3.1-70B", 80, 0, 0)])
def test_structure(name, layers, experts, top_k):
    shape = shape_of(name)
    spec = shape.spec
    assert (spec.num_layers, spec.num_experts, spec.num_experts_per_tok) == (layers, experts, top_k)
    assert shape.experts_per_layer == experts
