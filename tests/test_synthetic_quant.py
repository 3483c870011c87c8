"""tools/synthetic_quant.py: quantized checkpoints written tensor by tensor (gpu_check's full-depth int4 model)."""
import json

import pytest

from tools.quant_writers import QuantOptions
from tools.synthetic_quant import SLACK, expected_bytes, tensor_shapes, write_synthetic

TINY = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 2, "vocab_size": 256, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": False}


@pytest.mark.parametrize("quant", ["ct-int4", "gptq", "fp8-block"])
def test_written_folder_opens_and_runs(tmp_path, quant):
    from offload_engine import Engine
    from offload_engine.checkpoint.model import open_model

    out = tmp_path / quant
    result = write_synthetic(TINY, out, quant, shard_bytes=100_000)
    assert result["bytes"] == expected_bytes(tensor_shapes(TINY), quant, QuantOptions())  # the disk check's figure
    assert result["shards"] > 1 and not (tmp_path / f"{quant}.partial").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] in ("compressed-tensors", "gptq", "fp8")
    checkpoint = open_model(out)  # every tensor the config implies, per expert as the releases name them
    assert not checkpoint.fused_experts and checkpoint.formats
    with Engine.open(out, max_context=64) as engine:
        tokens = engine.generate(list(range(1, 9)), max_new_tokens=4, ignore_eos=True).token_ids
    assert len(tokens) == 4


def test_realistic_routing_writes_the_routing_tools_tensors(tmp_path):
    """--routing realistic: the embedding, head and routers are tools/realistic_routing.py's (in float32, rounded
    once to the checkpoint's bf16), the rest is noise as before."""
    import torch
    from safetensors import safe_open

    from tools.realistic_routing import MARKER, RoutingPreset, routing_weights

    out = tmp_path / "realistic"
    write_synthetic(TINY, out, "ct-int4", realistic=True)
    embed, head, routers, _ = routing_weights(256, 64, 8, [0, 1], RoutingPreset(), dtype=torch.float32)
    got = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            got.update({n: f.get_tensor(n) for n in f.keys()
                        if n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight")})
    assert torch.equal(got["model.embed_tokens.weight"], embed.to(torch.bfloat16))
    assert torch.equal(got["lm_head.weight"], head.to(torch.bfloat16))
    assert torch.equal(got["model.layers.1.mlp.gate.weight"], routers[1].to(torch.bfloat16))
    assert (out / MARKER).is_file()


def test_a_disk_without_room_is_refused_before_writing(tmp_path, monkeypatch):
    """The free-disk check names what the checkpoint needs and what the disk has, and writes nothing."""
    import shutil

    free = expected_bytes(tensor_shapes(TINY), "ct-int4", QuantOptions()) + SLACK - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(free * 2, free, free))
    with pytest.raises(SystemExit, match=r"needs 0\.\d+ GiB .* GiB free"):
        write_synthetic(TINY, tmp_path / "full", "ct-int4")
    assert list(tmp_path.iterdir()) == []
