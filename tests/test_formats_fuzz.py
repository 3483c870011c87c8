"""Fuzzing the quantized tensors (RELIABILITY.md F17 for the formats of issue 28): each example takes a valid
checkpoint of one format (fp8 blocks, compressed-tensors int4 / asymmetric int8, GPTQ with act-order, AWQ,
MXFP4), mutates one of its quantization tensors (scales, packed data, zero points, g_idx, weight_shape, MXFP4
blocks and scales): dropped, cut, grown, retyped, transposed, flattened or refilled with arbitrary values, and
opens it and computes one forward. The only outcomes allowed: success (garbage values are data the format cannot
tell from weights) or an error of the engine's own family naming what is wrong. Never another exception, a crash
or a hang. Values the format constrains (g_idx within its groups, weight_shape equal to the weight's shape) must
be refused, not computed with.

CI runs 200 examples (~7 s); more with OFFLOAD_ENGINE_FORMAT_FUZZ_EXAMPLES=2000.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from offload_engine import Engine
from offload_engine.errors import CheckpointError, OffloadEngineError
from test_formats_parity import _options

EXAMPLES = int(os.environ.get("OFFLOAD_ENGINE_FORMAT_FUZZ_EXAMPLES", "200"))
FORMATS = {"fp8-block": {}, "ct-int4": {}, "ct-int8": {"symmetric": False}, "gptq": {"desc_act": True},
           "awq": {}, "mxfp4": {}}
QUANT_PART = re.compile(r"(_scale_inv|_packed|_scale|_zero_point|_shape|\.qweight|\.qzeros|\.scales|\.g_idx|"
                        r"_blocks|_scales)$")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8, torch.uint8,
          torch.float8_e4m3fn]
MUTATIONS = ("drop", "cut", "grow", "retype", "transpose", "flatten", "refill")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tools.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("fuzz-formats")
    out = {}
    for quant, extra in FORMATS.items():
        path = make_checkpoint("qwen3_moe", "tiny", root / quant, quant=quant, fused_experts=quant == "mxfp4",
                               quant_options=_options(quant, extra))
        tensors = {}
        for shard in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(shard))
        parts = sorted(n for n in tensors if QUANT_PART.search(n))
        out[quant] = (path, tensors, parts)
    return out


def mutate(t: torch.Tensor, how: str, data: st.DataObject) -> torch.Tensor | None:
    if how == "drop":
        return None
    if how == "cut" and t.dim() and t.shape[-1] > 1:
        return t[..., :-1].contiguous()
    if how == "grow" and t.dim():
        return torch.cat([t, t[..., :1]], dim=-1).contiguous()
    if how == "retype":
        return t.to(torch.float32).to(data.draw(st.sampled_from(DTYPES), label="dtype"))
    if how == "transpose" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous()
    if how == "flatten" and t.dim() >= 2:
        return t.reshape(-1).contiguous()
    # refill: arbitrary values of the same dtype and shape (out-of-range g_idx, wrong weight_shape, huge scales)
    value = data.draw(st.sampled_from([-1, 0, 1, 7, 255, 2**20, -(2**31)]), label="value")
    filled = torch.full(t.shape, value, dtype=torch.int64)
    return filled.to(t.dtype) if not t.is_floating_point() else filled.to(torch.float32).to(t.dtype)


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_quantization_tensors_are_refused_by_name_or_computed(folders, tmp_path_factory, data):
    quant = data.draw(st.sampled_from(sorted(FORMATS)), label="format")
    src, tensors, parts = folders[quant]
    name = data.draw(st.sampled_from(parts), label="tensor")
    how = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    dst = tmp_path_factory.mktemp("variant")
    edited = dict(tensors)
    new = mutate(tensors[name], how, data)
    if new is None:
        edited.pop(name)
    else:
        edited[name] = new
    save_file(edited, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    try:
        with Engine.open(dst, dtype="float32", max_context=16) as engine:
            engine.logits([1, 2, 3])
    except CheckpointError as e:  # a broken tensor: named, in the file that holds it (or config.json); a missing
        assert e.tensor is not None or "config.json" in e.path, str(e)  # one, in the folder that lacks it
        assert e.path.endswith(("model.safetensors", "config.json", dst.name)), str(e)
    except OffloadEngineError:
        pass  # e.g. a plan error: the engine's own family, with its message
    else:  # computed: only values the format cannot check may pass. Data is checked where a unit lands, so this
        # holds for the units every forward uses; a routed expert's data is checked when it is first routed to
        if ".experts." in name:
            return
        if name.endswith(".g_idx") and how == "refill":
            groups = int(tensors[name].max()) + 1
            assert 0 <= int(new.min()) and int(new.max()) < groups, "an out-of-range g_idx was computed with"
        if name.endswith("_shape") and how == "refill":
            assert new.tolist() == tensors[name].tolist(), "a wrong weight_shape was computed with"
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def test_every_format_has_its_quantization_tensors(folders):
    """The fuzz reaches each format's components (a writer change that renamed them would silently skip them)."""
    want = {"fp8-block": "_scale_inv", "ct-int4": "_packed", "ct-int8": "_zero_point", "gptq": ".g_idx",
            "awq": ".qzeros", "mxfp4": "_blocks"}
    for quant, suffix in want.items():
        assert any(n.endswith(suffix) for n in folders[quant][2]), quant
    assert json.loads((folders["gptq"][0] / "config.json").read_text())["quantization_config"]["desc_act"]
