"""gpt-oss against transformers' GptOssForCausalLM: sinks, alternating sliding-window / full attention (a 4-position
window in the test checkpoints, so a 48-token prompt slides), biased router and experts, the clamped SwiGLU, YaRN;
in fp32 and in the releases' MXFP4 (reference: transformers' own MXFP4 dequantization), resident and at a 25% budget
that streams the experts."""
from __future__ import annotations

import pytest
import torch

from offload_engine import Engine
from tests.test_formats_parity import check_against, dequantized_folder


def test_fp32_matches_transformers_resident_and_streaming(checkpoint_factory):
    path = checkpoint_factory("gpt_oss", "offload")
    check_against(path, path, budgets=(None, "25%"))


def test_mxfp4_matches_transformers_dequantization(checkpoint_factory, tmp_path):
    qpath = checkpoint_factory("gpt_oss", "offload", quant="mxfp4")
    check_against(qpath, dequantized_folder(qpath, tmp_path / "ref"), budgets=(None, "25%"))


def test_mxfp4_units_hold_the_blocks_and_the_rest_stays_as_released(checkpoint_factory):
    from offload_engine.checkpoint.model import open_model

    ck = open_model(checkpoint_factory("gpt_oss", quant="mxfp4"))
    assert not ck.unused_tensors
    assert {q.kind for q in ck.formats.values()} == {"mxfp4"}
    assert all(".experts." in name for name in ck.formats)  # attention, router, embeddings, head: not converted
    expert = next(k for k in ck.layouts if k.kind == "expert")
    locals_ = {s.local for s in ck.layouts[expert].slices}
    assert {"gate_up_bias", "down_bias"} <= locals_ and any(n.startswith("gate_up@q:") for n in locals_)


def test_bf16_runs(checkpoint_factory):
    with Engine.open(checkpoint_factory("gpt_oss", quant="mxfp4"), dtype="bfloat16") as engine:
        assert torch.isfinite(engine.logits(list(range(1, 20)))).all()


def test_bad_config_is_refused_by_name(tmp_path, checkpoint_factory):
    import json
    import shutil

    from offload_engine.errors import ConfigError

    path = tmp_path / "bad"
    shutil.copytree(checkpoint_factory("gpt_oss"), path)
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = 0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="sliding_window"):
        Engine.open(path)
