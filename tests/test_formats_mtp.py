"""DeepSeek-V3 (MLA, grouped routing, MTP) released quantized: the trunk against transformers on the dequantized
weights, and the MTP layer, quantized like the trunk as the releases do, against the same layer read from the
dequantized copy (the plain MTP path is checked against transformers' MtpModel in test_mtp.py)."""
from __future__ import annotations

import pytest
import torch

from offload_engine.checkpoint.model import open_model
from offload_engine.checkpoint.naming import UnitKey
from offload_engine.runtime.model import CausalLM
from offload_engine.runtime.mtp import MtpHead, attach_mtp_units
from offload_engine.store.resident import ResidentWeights
from test_formats_parity import _options, check_against, dequantized_folder

CPU = torch.device("cpu")


def mtp_logits(path) -> torch.Tensor:
    ck = attach_mtp_units(open_model(path))
    model = CausalLM(ck, ResidentWeights(ck, CPU, torch.float32), CPU, torch.float32)
    head = MtpHead(model)
    ids = torch.randint(0, ck.spec.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    _, hidden = model.forward(ids, model.new_cache(32), return_hidden=True)
    hidden = head.trunk_hidden(hidden)
    logits, _ = head.forward(0, ids[1:], hidden[:-1], torch.arange(1, 20), head.new_cache(32))
    return logits


@pytest.mark.parametrize("quant", ["fp8-block", "ct-int4", "gptq", "awq"])
def test_deepseek_v3_with_mtp(checkpoint_factory, tmp_path, quant):
    qpath = checkpoint_factory("deepseek_v3", mtp=1, quant=quant, quant_options=_options(quant, {}))
    ref = dequantized_folder(qpath, tmp_path / "ref")
    check_against(qpath, ref)
    ck = attach_mtp_units(open_model(qpath))
    mtp_unit = ck.schema.units[UnitKey(ck.spec.num_layers, "mtp")]
    assert any("@q:" in local for local in mtp_unit), "the MTP layer's projections are stored quantized"
    ours, theirs = mtp_logits(qpath), mtp_logits(ref)
    assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
