"""Malformed quantized checkpoints: each refused naming the file and the tensor (or config.json and the field),
from the headers alone where the headers can tell, else where the unit's data first lands."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_engine import Engine
from offload_engine.checkpoint.model import open_model
from offload_engine.errors import CheckpointFormatError
from test_formats_parity import _options

Q = "model.layers.1.self_attn.q_proj"
Q0 = "model.layers.0.self_attn.q_proj"  # the first weight checked


def variant(src: Path, dst: Path, tensors_fn: Callable[[dict], None] | None = None,
            config_fn: Callable[[dict], None] | None = None) -> Path:
    """A copy of `src` as one model.safetensors, its tensors and quantization_config edited."""
    dst.mkdir()
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    if tensors_fn:
        tensors_fn(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if config_fn:
        config_fn(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from tools.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("quantized")
    return {q: make_checkpoint("qwen3_moe", "tiny", root / q, quant=q, quant_options=_options(q, {}))
            for q in ("fp8-block", "ct-int4", "gptq", "awq")}


def refused(path: Path, tensor: str | None, *words: str) -> CheckpointFormatError:
    with pytest.raises(CheckpointFormatError) as err:
        open_model(path)
    e = err.value
    assert e.tensor == tensor, str(e)
    assert "model.safetensors" in e.path or "config.json" in e.path, str(e)
    for w in words:
        assert w in str(e), str(e)
    return e


def test_missing_fp8_scale(quantized, tmp_path):
    path = variant(quantized["fp8-block"], tmp_path / "v", lambda t: t.pop(Q + ".weight_scale_inv"))
    refused(path, Q + ".weight_scale_inv", "missing", Q + ".weight")


def test_fp8_scale_of_the_wrong_shape(quantized, tmp_path):
    def edit(t):
        t[Q + ".weight_scale_inv"] = t[Q + ".weight_scale_inv"][:, :1].contiguous()
    refused(variant(quantized["fp8-block"], tmp_path / "v", edit), Q + ".weight_scale_inv", "shape", "blocks of 16x16")


def test_fp8_weight_block_size_that_does_not_match_the_scales(quantized, tmp_path):
    """The scales were written for 16x16 blocks; a config claiming 32x32 does not cover the weight with them."""
    path = variant(quantized["fp8-block"], tmp_path / "v", config_fn=lambda c: c.update(weight_block_size=[32, 32]))
    refused(path, Q0 + ".weight_scale_inv", "blocks of 32x32", "expected [2, 2]")


@pytest.mark.parametrize("bad", [[128], [0, 128], "128", [128, -1]])
def test_fp8_malformed_weight_block_size(quantized, tmp_path, bad):
    path = variant(quantized["fp8-block"], tmp_path / "v", config_fn=lambda c: c.update(weight_block_size=bad))
    refused(path, None, "weight_block_size")


def test_ct_group_size_that_does_not_divide(quantized, tmp_path):
    def edit(c):
        c["config_groups"]["group_0"]["weights"]["group_size"] = 48
    refused(variant(quantized["ct-int4"], tmp_path / "v", config_fn=edit), Q0 + ".weight_packed", "group_size 48",
            "does not divide in_features 64")


def test_ct_packed_data_of_the_wrong_length(quantized, tmp_path):
    def edit(t):
        t[Q + ".weight_packed"] = t[Q + ".weight_packed"][:, :-1].contiguous()
    refused(variant(quantized["ct-int4"], tmp_path / "v", edit), Q + ".weight_packed", "weight_packed", "shape")


def test_ct_missing_scale(quantized, tmp_path):
    path = variant(quantized["ct-int4"], tmp_path / "v", lambda t: t.pop(Q + ".weight_scale"))
    refused(path, Q + ".weight_scale", "missing")


def test_gptq_qweight_of_the_wrong_length(quantized, tmp_path):
    def edit(t):
        t[Q + ".qweight"] = t[Q + ".qweight"][:-1].contiguous()
    refused(variant(quantized["gptq"], tmp_path / "v", edit), Q + ".qweight", "qweight", "shape")


def test_gptq_scales_of_the_wrong_shape(quantized, tmp_path):
    def edit(t):
        t[Q + ".scales"] = torch.cat([t[Q + ".scales"]] * 2)
    refused(variant(quantized["gptq"], tmp_path / "v", edit), Q + ".scales", "scales", "shape")


def test_gptq_g_idx_out_of_range_is_refused_where_the_data_lands(quantized, tmp_path):
    def edit(t):
        t[Q + ".g_idx"][3] = 99
    path = variant(quantized["gptq"], tmp_path / "v", edit)
    open_model(path)  # the headers are fine: g_idx is data
    with Engine.open(path, dtype="float32") as engine, pytest.raises(CheckpointFormatError) as err:
        engine.logits([1, 2, 3])
    assert err.value.tensor == Q + ".g_idx" and "model.safetensors" in err.value.path
    assert "99" in str(err.value)


def test_awq_missing_qzeros(quantized, tmp_path):
    path = variant(quantized["awq"], tmp_path / "v", lambda t: t.pop(Q + ".qzeros"))
    refused(path, Q + ".qzeros", "missing")


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "quanto", None])
def test_unknown_quant_method_is_refused_by_name(quantized, tmp_path, method):
    path = variant(quantized["fp8-block"], tmp_path / "v", config_fn=lambda c: c.update(quant_method=method))
    e = refused(path, None, repr(method), "supported: fp8, compressed-tensors, gptq, awq, mxfp4")
    assert e.path.endswith("config.json")
