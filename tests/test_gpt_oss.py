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


def test_the_window_and_the_sinks_change_the_output(checkpoint_factory):
    """The test model exercises what the parity tests claim: a full window, or sinks of -inf, change transformers'
    logits (so matching them is not an accident of short prompts or negligible sinks)."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_factory("gpt_oss", "offload"),
                                                            dtype=torch.float32).eval()
    ids = torch.arange(1, 41)[None]
    with torch.no_grad():
        base = ref(ids).logits
        ref.config.layer_types = ["full_attention"] * len(ref.model.layers)
        wide = ref(ids).logits
        for layer in ref.model.layers:
            layer.self_attn.sinks.fill_(-1e30)
        no_sinks = ref(ids).logits
    assert (wide - base).abs().max() > 1e-3 and (no_sinks - wide).abs().max() > 1e-3


@pytest.mark.parametrize("width", [1, 3])
def test_speculative_trees_are_lossless(checkpoint_factory, width):
    """Draft trees through the sliding layers: a branch's keys carry their own positions in the window mask. The
    self-drafter (the model on its resident experts: all of them here) drafts every step, most of it accepted."""
    from offload_engine.generate.decoder import FinishEvent, GenerationState, drive
    from offload_engine.generate.sampling import Sampler, SamplingParams
    from offload_engine.speculative.stepper import make_stepper

    with Engine.open(checkpoint_factory("gpt_oss", "offload"), dtype="float32", max_context=96) as engine:
        ids = list(range(3, 51))
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        runs = {}
        for spec in ("off", "self"):
            cache = engine.model.new_cache(len(ids) + params.max_new_tokens)
            stepper = make_stepper(engine.model, cache, Sampler(params), spec, depth=3, width=width,
                                   store=engine.store, tokenizer=engine.tokenizer)
            events = list(drive(stepper, ids, GenerationState(params, engine.tokenizer)))
            assert isinstance(events[-1], FinishEvent)
            runs[spec] = (events[-1].token_ids, stepper)
    assert runs["self"][0] == runs["off"][0]
    stats = runs["self"][1].stats
    assert stats.spec_steps > 3 and stats.drafted >= stats.spec_steps * width and stats.accepted > stats.spec_steps
