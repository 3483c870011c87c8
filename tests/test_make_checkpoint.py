"""tools/make_checkpoint.py writes real HF checkpoints that transformers itself loads."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parents[1]))
from tools.make_checkpoint import ARCHS, MOE_ARCHS, main, make_checkpoint  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(arch, "tiny", root / arch) for arch in ARCHS}


def _load(folder: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    # Safetensors mmaps leave some tensors unaligned, which changes float sums by an ulp on CPU;
    # fresh (aligned) copies make logits comparisons exact.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def _digest(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_layout_and_load(tiny, arch):
    out = tiny[arch]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert cfg["vocab_size"] == len(tok) == 512
    assert cfg["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((out / s).is_file() for s in shards)

    model = _load(out)
    ids = torch.tensor([tok("def fibonacci(n):").input_ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    gen = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
    assert len(set(gen.tolist())) >= 8, "random init is degenerate: greedy output barely varies"


def test_arch_specific_features(tiny):
    cfg = {a: json.loads((tiny[a] / "config.json").read_text()) for a in ARCHS}
    assert cfg["llama"]["rope_parameters"]["rope_type"] == "llama3"
    assert cfg["qwen3"]["tie_word_embeddings"] is True
    assert cfg["qwen3_moe"]["mlp_only_layers"] == [0] and cfg["qwen3_moe"]["norm_topk_prob"] is True
    assert cfg["qwen2_moe"]["shared_expert_intermediate_size"] > 0
    ds = cfg["deepseek_v3"]
    assert ds["rope_parameters"]["rope_type"] == "yarn" and ds["first_k_dense_replace"] == 1
    qwen2_keys = json.loads((tiny["qwen2"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2_keys
    mixtral_keys = json.loads((tiny["mixtral"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in mixtral_keys
    bias = _load(tiny["deepseek_v3"]).model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0


def test_deterministic(tiny, tmp_path):
    again = make_checkpoint("qwen3_moe", "tiny", tmp_path / "again")
    assert _digest(again) == _digest(tiny["qwen3_moe"])
    other = make_checkpoint("qwen3_moe", "tiny", tmp_path / "other", seed=1)
    assert _digest(other) != _digest(again)


def test_refuses_overwrite(tmp_path, capsys):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_checkpoint("llama", "tiny", out)
    assert main(["--arch", "llama", "--preset", "tiny", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["--arch", "llama", "--preset", "tiny", "--out", str(out), "--force", "--seed", "3"]) == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"], "temp folders left behind"


def test_fused_needs_moe(tmp_path):
    with pytest.raises(ValueError):
        make_checkpoint("llama", "tiny", tmp_path / "x", fused_experts=True)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_experts_match_per_expert(tiny, tmp_path, arch):
    fused = make_checkpoint(arch, "tiny", tmp_path / "fused", fused_experts=True)
    keys = json.loads((fused / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys
    assert "model.layers.1.mlp.experts.down_proj" in keys
    assert not any(".experts.0." in k for k in keys)
    from safetensors import safe_open

    with safe_open(fused / keys["model.layers.1.mlp.experts.gate_up_proj"], "pt") as f:
        e, two_i, h = f.get_slice("model.layers.1.mlp.experts.gate_up_proj").get_shape()
    assert (e, h) == (8, 64) and two_i == 64  # [E, 2*I, H] with I = 32

    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(_load(fused)(ids).logits, _load(tiny[arch])(ids).logits)
