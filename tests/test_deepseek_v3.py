"""DeepSeek-V3 (MLA + grouped sigmoid routing + YaRN) against transformers' own implementation, in fp32."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offload_engine.checkpoint.hf_config import parse_config  # noqa: E402
from offload_engine.checkpoint.model import open_model  # noqa: E402
from offload_engine.checkpoint.naming import UnitKey  # noqa: E402
from offload_engine.errors import ConfigError  # noqa: E402
from offload_engine.checkpoint.arch.deepseek_v3 import NAMING as ARCH  # noqa: E402
from offload_engine.runtime.arch import build_ops  # noqa: E402
from offload_engine.runtime.model import CausalLM  # noqa: E402
from offload_engine.store.resident import ResidentWeights  # noqa: E402

PROMPT, NEW = 64, 32
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True,
            max_position_embeddings=512, rope_scaling=YARN)
VARIANTS = {
    "yarn": {},
    "no_q_lora": {"q_lora_rank": None},
    "no_rope_scaling": {"rope_scaling": None},
    "rotate_half": {"rope_interleave": False},
    # attention_factor != 1 (mscale != mscale_all_dim), biases, one group (Kimi K2), no renormalization
    "kimi_like": {"rope_scaling": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.2}, "attention_bias": True,
                  "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "n_shared_experts": 2},
    "bf16": {"_dtype": torch.bfloat16},
    # transformers 5 keeps the router (gate.weight, correction bias) in fp32 in a bf16 model: F32 next to BF16
    "bf16_fp32_router": {"_dtype": torch.bfloat16, "_keep_fp32_router": True},
    "fused": {"_fused": True},
}


def build(root: Path, name: str) -> Path:
    opts = dict(VARIANTS[name])
    dtype, fused, keep_fp32 = opts.pop("_dtype", None), opts.pop("_fused", False), opts.pop("_keep_fp32_router", 0)
    config = transformers.DeepseekV3Config(**{**BASE, **opts})
    torch.manual_seed(0)
    if keep_fp32:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        dtype = None
    else:
        model = transformers.DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers[config.first_k_dense_replace:]:
        bias = layer.mlp.gate.e_score_correction_bias  # nonzero: the selection-only bias path is exercised
        bias.copy_(0.05 * torch.randn(bias.shape, generator=gen))
    if dtype is not None:
        model.to(dtype)
    out = root / name
    model.save_pretrained(out, max_shard_size="200KB", save_original_format=not fused)
    return out


class Loaded:
    def __init__(self, path: Path):
        self.ck = open_model(path)
        src = ResidentWeights(self.ck, torch.device("cpu"), torch.float32)
        self.model = CausalLM(self.ck, src, torch.device("cpu"), torch.float32)
        self.ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.ref.generation_config.eos_token_id = None  # full-length greedy runs
        self.ids = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            self.expected = self.ref(self.ids[None]).logits[0].float()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("deepseek_v3"), {}

    def get(name: str) -> Loaded:
        if name not in cache:
            cache[name] = Loaded(build(root, name))
        return cache[name]

    return get


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    scale, diff = theirs.abs().max().item(), (ours - theirs).abs().max().item()
    assert diff <= 1e-4 * scale, f"max |diff| {diff:.3g} > 1e-4 x max|logit| {scale:.3g}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(loaded, variant):
    m = loaded(variant)
    assert m.ck.unused_tensors == []
    assert_close(m.model.forward(m.ids, m.model.new_cache(128)), m.expected)


@pytest.mark.parametrize("variant", ["yarn", "no_q_lora", "kimi_like"])
@pytest.mark.parametrize("absorb", [None, True, False])
def test_decode_after_prefill_matches_transformers(loaded, variant, absorb):
    """The compressed-cache path, both through kv_b_proj expansion and with kv_b_proj absorbed."""
    m = loaded(variant)
    m.model.ops.absorb = absorb
    try:
        cache = m.model.new_cache(128)
        prefill = m.model.forward(m.ids[:40], cache)
        steps = torch.cat([m.model.forward(m.ids[i:i + 1], cache) for i in range(40, PROMPT)])
    finally:
        m.model.ops.absorb = None
    assert_close(torch.cat([prefill, steps]), m.expected)
    a = m.ck.args  # the cache holds the latent and the rope key only
    assert cache.nbytes == a.spec.num_layers * 128 * (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    assert cache.nbytes == 128 * m.model.ops.kv_bytes_per_token(4)


@pytest.mark.parametrize("variant", ["yarn", "no_rope_scaling", "bf16"])
def test_greedy_generation_matches_transformers(loaded, variant):
    m = loaded(variant)
    cache, tokens = m.model.new_cache(PROMPT + NEW), []
    logits = m.model.forward(m.ids, cache, last_only=True)
    for _ in range(NEW):
        tokens.append(int(logits[-1].argmax()))
        logits = m.model.forward(torch.tensor(tokens[-1:]), cache)
    with torch.no_grad():
        expected = m.ref.generate(m.ids[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, PROMPT:]
    assert tokens == expected.tolist()
    assert len(set(tokens)) > 1, "degenerate random model: greedy output is one repeated token"


@pytest.mark.parametrize("overrides", [{}, {"n_group": 1, "topk_group": 1}, {"norm_topk_prob": False},
                                       {"n_routed_experts": 16, "n_group": 8, "topk_group": 3,
                                        "num_experts_per_tok": 4}])
def test_router_matches_transformers(overrides):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(**{**BASE, **overrides})
    router = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(router.weight.shape, generator=g)
    router.e_score_correction_bias.copy_(0.1 * torch.randn(router.num_experts, generator=g))
    x = torch.randn(200, config.hidden_size, generator=g)
    _, ref_weights, ref_idx = router(x)
    spec = parse_config(config.to_dict())
    ops = build_ops(ARCH.name, ARCH.args(spec), torch.device("cpu"), torch.float32)
    w = {"mlp.gate.weight": router.weight.data, "mlp.gate.e_score_correction_bias": router.e_score_correction_bias}
    idx, weights = ops.route(1, w, x)
    assert torch.equal(idx, ref_idx)
    assert weights.dtype == ref_weights.dtype == torch.float32
    assert torch.equal(weights, ref_weights)


def test_schema_layout(loaded):
    ck = loaded("yarn").ck
    a, n = ck.args, ck.spec.num_layers
    assert a.moe_layers == frozenset({1, 2}) and a.num_nextn_predict_layers == 1
    assert max(k.layer for k in ck.schema.keys("dense")) == n - 1  # MTP layers stay out of the schema
    moe = ck.schema.units[UnitKey(1, "dense")]
    assert moe["mlp.gate.weight"].dtype == moe["mlp.gate.e_score_correction_bias"].dtype == "any"
    assert moe["shared.gate"].shape == (a.moe_intermediate_size * a.n_shared_experts, ck.spec.hidden_size)
    assert "mlp.gate" in ck.schema.units[UnitKey(0, "dense")]
    assert len(list(ck.schema.keys("expert"))) == 2 * ck.spec.num_experts


@pytest.mark.parametrize("field, value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                          ("n_group", 3), ("topk_group", 5), ("moe_layer_freq", 0)])
def test_unsupported_configs_are_refused(field, value):
    cfg = transformers.DeepseekV3Config(**BASE).to_dict()
    cfg[field] = value
    with pytest.raises(ConfigError, match=field):
        ARCH.args(parse_config(cfg))


# DeepSeek-V3's released config.json (the fields that matter here), in the classic hub spelling
RELEASED = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
    first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
    max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, torch_dtype="bfloat16",
    tie_word_embeddings=False, num_nextn_predict_layers=1,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"})


def test_released_config_rope_and_softmax_scale_match_transformers():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ref

    config = transformers.DeepseekV3Config(**{k: v for k, v in RELEASED.items() if k != "model_type"})
    spec = parse_config(RELEASED)
    a = ARCH.args(spec)
    assert a.softmax_scale == ref.yarn_apply_mscale(config.rope_parameters, config.qk_head_dim ** -0.5)
    assert a.moe_layers == frozenset(range(3, 61)) and a.qk_head_dim == 192
    ops = build_ops(ARCH.name, a, torch.device("cpu"), torch.float32)
    rotary = ref.DeepseekV3RotaryEmbedding(config)
    assert torch.equal(ops.rotary.inv_freq, rotary.inv_freq)
    assert ops.rotary.attention_scaling == rotary.attention_scaling
    assert ops.kv_bytes_per_token(2) == 61 * (512 + 64) * 2  # 70 KB per token vs 61 * 2 * 128 * 192 * 2 for K/V
    schema = ARCH.schema(a)
    attn = schema.units[UnitKey(0, "dense")]
    assert attn["self_attn.kv_b_proj.weight"].shape == (128 * 256, 512)
    assert attn["self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert len(list(schema.keys("expert"))) == 58 * 256
