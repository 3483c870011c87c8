"""DeepSeek-V3 / R1 and Kimi K2, naming half: DeepseekV3Args (MLA ranks and head dims, grouped sigmoid routing with
shared experts, MTP layers) parsed and checked from config.json, and the tensors of the trunk (`schema`) and of the
multi-token-prediction layers (`mtp_schema`, added to an opened checkpoint when their tensors are present:
runtime/mtp.py). The ops (MLA, routing) are runtime/arch/deepseek_v3.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..hf_config import ModelSpec, yarn_mscale
from ..naming import ModelSchema, TensorSpec, UnitKey
from .base import DecoderArgs, StandardNaming, add_embed_and_head, add_experts, add_gated_mlp, with_formats

LATENT_NORM_EPS = 1e-6  # q_a/kv_a_layernorm use the RMSNorm default in both reference codes, not rms_norm_eps
ATTN = "self_attn."


@dataclass(frozen=True)
class DeepseekV3Args(DecoderArgs):
    q_lora_rank: int | None = None  # None: a plain q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = True
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0
    softmax_scale: float = 1.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _require(spec: ModelSpec, field: str, value, allowed: tuple) -> None:
    if value is not None and value not in allowed:
        raise ConfigError(f"{spec.path}: {field}={value!r} is not supported for deepseek_v3; supported: "
                          f"{', '.join(map(repr, allowed))}")


def _int(spec: ModelSpec, field: str, default: int | None = None, minimum: int = 1) -> int:
    value = spec.get(field)
    value = default if value is None else value  # null in config.json means the default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{spec.path}: {field} must be an integer >= {minimum}, found {value!r}")
    return value


def _softmax_scale(spec: ModelSpec, qk_head_dim: int) -> float:
    """transformers' yarn_apply_mscale: any non-default rope with mscale_all_dim scales 1/sqrt(d) by mscale**2."""
    scale, p = qk_head_dim ** -0.5, spec.rope.params
    if spec.rope.rope_type != "default" and p.get("mscale_all_dim"):
        factor = p.get("factor") or spec.max_position_embeddings / float(p["original_max_position_embeddings"])
        scale *= yarn_mscale(float(factor), float(p["mscale_all_dim"])) ** 2
    return scale


def _check_routing(spec: ModelSpec, n_group: int, topk_group: int) -> None:
    _require(spec, "scoring_func", spec.get("scoring_func"), ("sigmoid",))
    _require(spec, "topk_method", spec.get("topk_method"), ("noaux_tc",))
    E, k = spec.num_experts, spec.num_experts_per_tok
    if E and E % n_group:
        raise ConfigError(f"{spec.path}: n_group={n_group} must divide n_routed_experts={E}")
    if E and not 1 <= topk_group <= n_group:
        raise ConfigError(f"{spec.path}: topk_group={topk_group} must be in [1, n_group={n_group}]")
    if E and ((n_group > 1 and E // n_group < 2) or k > topk_group * (E // n_group)):
        raise ConfigError(f"{spec.path}: num_experts_per_tok={k} cannot be drawn from topk_group={topk_group} "
                          f"groups of {E // n_group} experts (groups need >= 2 experts)")


def _args(spec: ModelSpec) -> DeepseekV3Args:
    n_group, topk_group = _int(spec, "n_group", 1), _int(spec, "topk_group", 1)
    _check_routing(spec, n_group, topk_group)
    q_lora = spec.get("q_lora_rank")
    nope, rope = _int(spec, "qk_nope_head_dim"), _int(spec, "qk_rope_head_dim")
    first_dense, freq = _int(spec, "first_k_dense_replace", 0, minimum=0), _int(spec, "moe_layer_freq", 1)
    # DeepSeek's rule (transformers drops moe_layer_freq; every release uses 1, where both agree)
    moe = frozenset(l for l in range(spec.num_layers) if spec.num_experts and l >= first_dense and l % freq == 0)
    return DeepseekV3Args(
        spec, moe_layers=moe, moe_intermediate_size=_int(spec, "moe_intermediate_size"),
        norm_topk_prob=bool(spec.get("norm_topk_prob", True)),
        q_lora_rank=None if q_lora is None else _int(spec, "q_lora_rank"), kv_lora_rank=_int(spec, "kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=_int(spec, "v_head_dim"),
        n_shared_experts=_int(spec, "n_shared_experts", 0, minimum=0), first_k_dense_replace=first_dense,
        moe_layer_freq=freq, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=float(spec.get("routed_scaling_factor") or 1.0),
        rope_interleave=bool(spec.get("rope_interleave", True)), attention_bias=bool(spec.get("attention_bias")),
        num_nextn_predict_layers=_int(spec, "num_nextn_predict_layers", 0, minimum=0),
        softmax_scale=_softmax_scale(spec, nope + rope))


def _add_block(schema: ModelSchema, a: DeepseekV3Args, key: UnitKey, layer: int, moe: bool,
               fused_experts: bool) -> None:
    """One decoder block's tensors into unit `key` (routed experts into their own units of `layer`)."""
    s, H, heads, p = a.spec, a.spec.hidden_size, a.spec.num_heads, f"model.layers.{layer}."

    def add(local: str, shape: tuple[int, ...], dtype: str | None = None) -> None:
        schema.add(key, local, TensorSpec(p + local, shape, dtype=dtype))

    add("input_layernorm.weight", (H,))
    add("post_attention_layernorm.weight", (H,))
    if a.q_lora_rank is None:
        add(ATTN + "q_proj.weight", (heads * a.qk_head_dim, H))
    else:
        add(ATTN + "q_a_proj.weight", (a.q_lora_rank, H))
        add(ATTN + "q_a_layernorm.weight", (a.q_lora_rank,))
        add(ATTN + "q_b_proj.weight", (heads * a.qk_head_dim, a.q_lora_rank))
    add(ATTN + "kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, H))
    add(ATTN + "kv_a_layernorm.weight", (a.kv_lora_rank,))
    add(ATTN + "kv_b_proj.weight", (heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank))
    add(ATTN + "o_proj.weight", (H, heads * a.v_head_dim))
    if a.attention_bias:  # bias=attention_bias on these three only, as in the reference
        if a.q_lora_rank is not None:
            add(ATTN + "q_a_proj.bias", (a.q_lora_rank,))
        add(ATTN + "kv_a_proj_with_mqa.bias", (a.kv_lora_rank + a.qk_rope_head_dim,))
        add(ATTN + "o_proj.bias", (H,))
    if not moe:
        add_gated_mlp(schema, key, f"{p}mlp.", "mlp.", s.intermediate_size, H)
        return
    # Router: F32 beside BF16 is common (released bias; transformers 5 keeps both in fp32 when saving)
    add("mlp.gate.weight", (s.num_experts, H), dtype="any")
    add("mlp.gate.e_score_correction_bias", (s.num_experts,), dtype="any")
    if a.n_shared_experts:
        add_gated_mlp(schema, key, f"{p}mlp.shared_experts.", "shared.", a.moe_intermediate_size * a.n_shared_experts,
                      H)
    add_experts(schema, layer, p, "mlp", s.num_experts, a.moe_intermediate_size, H, a.expert_names, fused_experts)


class DeepseekV3Naming(StandardNaming):
    def schema(self, a: DeepseekV3Args, fused_experts: bool = False) -> ModelSchema:
        """The main model: embeddings, num_hidden_layers decoder layers, head (MTP layers: `mtp_schema`)."""
        s, schema = a.spec, ModelSchema()
        add_embed_and_head(schema, s)
        for l in range(s.num_layers):
            _add_block(schema, a, UnitKey(l, "dense"), l, l in a.moe_layers, fused_experts)
        return schema

    def mtp_schema(self, a: DeepseekV3Args, fused_experts: bool = False) -> ModelSchema:
        """The multi-token-prediction layers as released (DeepSeek-V3 / Kimi K2 / GLM-4.5 naming): layer
        N + i (N = num_hidden_layers) holds enorm, hnorm, eh_proj, shared_head.norm and a full decoder block
        (always MoE). One `mtp` unit per layer holds all but the routed experts, which are `expert` units of
        layer N + i. shared_head.head and embed_tokens copies in that layer are not used: the MTP layers share
        the main model's embedding and head (as transformers' MtpModel does)."""
        s, schema, H = a.spec, ModelSchema(), a.spec.hidden_size
        for i in range(a.num_nextn_predict_layers):
            layer = s.num_layers + i
            key, p = UnitKey(layer, "mtp"), f"model.layers.{layer}."
            for local, name, shape in (("mtp.embed_norm", "enorm.weight", (H,)),
                                       ("mtp.hidden_norm", "hnorm.weight", (H,)),
                                       ("mtp.proj", "eh_proj.weight", (H, 2 * H)),
                                       ("mtp.out_norm", "shared_head.norm.weight", (H,))):
                schema.add(key, local, TensorSpec(p + name, shape))
            _add_block(schema, a, key, layer, bool(s.num_experts), fused_experts)
        return with_formats(a, schema)


NAMING = DeepseekV3Naming("deepseek_v3", _args)
