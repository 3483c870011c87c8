"""Qwen3-Next (Qwen3-Next-80B-A3B): hybrid Gated DeltaNet / gated full attention, routed + shared experts.

Layers follow `layer_types` (else every `full_attention_interval`-th layer is full attention, the rest linear):
  full attention     Qwen3 attention (QK-norm) whose q_proj also yields a per-head output gate: out * sigmoid(gate);
                     partial rotary (`partial_rotary_factor`, 0.25 in the releases); the only layers with a KV cache
  linear attention   Gated DeltaNet (runtime/deltanet.py): in_proj_qkvz / in_proj_ba, grouped per key head, a short
                     causal conv, a float32 recurrent state per sequence kept in the cache
Every RMSNorm except the DeltaNet's gated one is zero-centred: x_hat * (1 + weight). MoE layers: softmax top-k
(`norm_topk_prob`) plus a sigmoid-gated shared expert; `mlp_only_layers` / `decoder_sparse_step` as in Qwen2-MoE.

Multi-token prediction (`mtp.*`, top-level names in Qwen3-Next and Qwen3.5 releases alike: fc, pre_fc_norm_embedding
/ _hidden, layers.{i}, norm; the trunk's embedding and head are shared) is described by `mtp_schema`, not by
`schema`: runtime/mtp.py adds it to an opened checkpoint and runs it with StandardOps' `mtp_*` ops, which use this
architecture's zero-centred `norm`. MTP layer i is checkpoint layer N + i (N = num_hidden_layers), a
full-attention MoE layer with a shared expert whatever `layer_types` / `mlp_only_layers` say (they describe the
trunk only). Its forward, as vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py run it (transformers has no Qwen MTP
module), with every norm zero-centred:

    x = fc([pre_fc_norm_embedding(embed(t_p)); pre_fc_norm_hidden(h_{p-1})])    (the embedding first)
    x = layer_i(x)                           (gated attention over its own KV cache, MoE + shared expert)
    o_p = mtp.norm(x)                        (handed to the next depth, as vLLM's proposer chains it)
    logits_p = lm_head(o_p)                  (the trunk's head, no further norm)

h_{p-1} at depth 0 is the trunk's last hidden state after its final norm (what vLLM's model forward returns).
qwen3_5_moe.py reuses all of this with Qwen3.5's separate projections and its vision-language wrapper's names.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..hf_config import ModelSpec
from ..naming import ModelSchema, TensorSpec, UnitKey
from .base import DecoderArgs, StandardNaming, add_experts, add_gated_mlp, with_formats
from .qwen2_moe import moe_layers

LINEAR, FULL = "linear_attention", "full_attention"
ATTN, LIN = "self_attn.", "linear_attn."
DEFAULT_ROTARY_FACTOR = 0.25


@dataclass(frozen=True)
class DeltaNetDims:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    # value head i reads key head i // (Hv / Hk) (grouped, the releases' order) or, tiled, i % Hk: the order
    # llama.cpp's converter gives Qwen3.5's value heads, kept as stored (checkpoint/gguf/hybrid.py)
    v_heads_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, itemsize: int) -> int:
        """One layer, one sequence: conv state in the compute dtype plus the float32 recurrent state."""
        conv = (self.conv_kernel - 1) * self.conv_dim * itemsize
        return conv + self.num_v_heads * self.k_head_dim * self.v_head_dim * 4

    def log_bytes_per_token(self, itemsize: int) -> int:
        """What one logged position costs: its conv input row, plus k, v, g, beta in float32."""
        return self.conv_dim * itemsize + 4 * self.num_v_heads * (self.k_head_dim + self.v_head_dim + 2)


@dataclass(frozen=True)
class HybridArgs(DecoderArgs):
    layer_types: tuple[str, ...] = ()
    deltanet: DeltaNetDims = DeltaNetDims(1, 1, 1, 1, 1)
    split_projections: bool = False  # Qwen3.5: in_proj_qkv / z / b / a instead of in_proj_qkvz / ba
    split_qkvz: bool = False  # in_proj_qkv / z with in_proj_ba (Qwen3-Next as llama.cpp's GGUF stores it)
    prefix: str = "model."  # where the language model's tensors live ("model.language_model." in Qwen3.5 releases)
    mtp_layers: int = 0

    def is_linear(self, layer: int) -> bool:
        """Layers past the trunk (MTP layers N + i) are full attention."""
        return layer < len(self.layer_types) and self.layer_types[layer] == LINEAR

    @property
    def full_layers(self) -> list[int]:
        return [l for l, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [l for l, t in enumerate(self.layer_types) if t == LINEAR]


def _int(spec: ModelSpec, field: str, default: int | None = None, minimum: int = 1) -> int:
    value = spec.get(field)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{spec.path}: {field} must be an integer >= {minimum}, found {value!r}")
    return value


def layer_types(spec: ModelSpec) -> tuple[str, ...]:
    types = spec.get("layer_types")
    if types is None:
        every = _int(spec, "full_attention_interval", 4)
        return tuple(FULL if (l + 1) % every == 0 else LINEAR for l in range(spec.num_layers))
    if not isinstance(types, list) or len(types) != spec.num_layers or not set(types) <= {LINEAR, FULL}:
        raise ConfigError(f"{spec.path}: layer_types must list {spec.num_layers} entries of {LINEAR!r} / {FULL!r}, "
                          f"found {types!r}")
    return tuple(types)


def deltanet_dims(spec: ModelSpec) -> DeltaNetDims:
    dims = DeltaNetDims(
        num_k_heads=_int(spec, "linear_num_key_heads", 16), num_v_heads=_int(spec, "linear_num_value_heads", 32),
        k_head_dim=_int(spec, "linear_key_head_dim", 128), v_head_dim=_int(spec, "linear_value_head_dim", 128),
        conv_kernel=_int(spec, "linear_conv_kernel_dim", 4, minimum=2))
    if dims.num_v_heads % dims.num_k_heads:
        raise ConfigError(f"{spec.path}: linear_num_value_heads={dims.num_v_heads} must be a multiple of "
                          f"linear_num_key_heads={dims.num_k_heads}")
    return dims


def _mtp_layers(spec: ModelSpec) -> int:
    """Qwen3.5 configs say `mtp_num_hidden_layers`; Qwen3-Next's released config says nothing, and its checkpoints
    carry one MTP layer (whether the tensors are really there is for whoever loads them to check)."""
    if spec.get("mtp_num_hidden_layers") is not None:
        return _int(spec, "mtp_num_hidden_layers", minimum=0)
    return _int(spec, "num_nextn_predict_layers", 1, minimum=0)


def hybrid_args(spec: ModelSpec, **overrides) -> HybridArgs:
    """The fields Qwen3-Next and Qwen3.5-MoE share; `overrides` sets what differs."""
    if spec.num_heads % spec.num_kv_heads:
        raise ConfigError(f"{spec.path}: num_attention_heads={spec.num_heads} must be a multiple of "
                          f"num_key_value_heads={spec.num_kv_heads}")
    bias = bool(spec.get("attention_bias", False))
    fields = dict(
        qkv_bias=bias, o_bias=bias, qk_norm=True, moe_layers=moe_layers(spec),
        moe_intermediate_size=_int(spec, "moe_intermediate_size", 0, minimum=0),
        norm_topk_prob=bool(spec.get("norm_topk_prob", True)),
        shared_intermediate_size=_int(spec, "shared_expert_intermediate_size", 0, minimum=0),
        layer_types=layer_types(spec), deltanet=deltanet_dims(spec),
        mtp_layers=_mtp_layers(spec))
    fields.update(overrides)
    args = HybridArgs(spec, **fields)
    if args.moe_layers and args.moe_intermediate_size < 1:
        raise ConfigError(f"{spec.path}: moe_intermediate_size must be an integer >= 1 for MoE layers")
    return args


def _args(spec: ModelSpec) -> HybridArgs:
    return hybrid_args(spec)


class HybridNaming(StandardNaming):
    def schema(self, a: HybridArgs, fused_experts: bool = False) -> ModelSchema:
        s, schema = a.spec, ModelSchema()
        V, H = s.vocab_size, s.hidden_size
        embed, head = UnitKey(-1, "embed"), UnitKey(s.num_layers, "head")
        schema.add(embed, "weight", TensorSpec(f"{a.prefix}embed_tokens.weight", (V, H)))
        schema.add(head, "norm", TensorSpec(f"{a.prefix}norm.weight", (H,)))
        tied = f"{a.prefix}embed_tokens.weight"
        schema.add(head, "weight", TensorSpec(tied if s.tie_word_embeddings else "lm_head.weight", (V, H)))
        for l in range(s.num_layers):
            self._add_layer(schema, a, UnitKey(l, "dense"), l, f"{a.prefix}layers.{l}.", a.is_linear(l),
                            l in a.moe_layers, fused_experts)
        return schema

    def mtp_schema(self, a: HybridArgs, fused_experts: bool = False) -> ModelSchema:
        """MTP layer i: UnitKey(num_layers + i, "mtp") (fc, norms, a full-attention MoE block) and its routed
        experts as UnitKey(num_layers + i, "expert", e). The embedding and head are the trunk's."""
        s, schema, H = a.spec, ModelSchema(), a.spec.hidden_size
        for i in range(a.mtp_layers):
            key = UnitKey(s.num_layers + i, "mtp")
            schema.add(key, "mtp.proj", TensorSpec("mtp.fc.weight", (H, 2 * H)))
            for local, norm in (("mtp.embed_norm", "pre_fc_norm_embedding"), ("mtp.hidden_norm", "pre_fc_norm_hidden"),
                                ("mtp.out_norm", "norm")):
                schema.add(key, local, TensorSpec(f"mtp.{norm}.weight", (H,)))
            self._add_layer(schema, a, key, s.num_layers + i, f"mtp.layers.{i}.", False, True, fused_experts)
        return with_formats(a, schema)

    def _add_layer(self, schema: ModelSchema, a: HybridArgs, key: UnitKey, layer: int, p: str, linear: bool,
                   moe: bool, fused_experts: bool) -> None:
        s, H, D, d = a.spec, a.spec.hidden_size, a.spec.head_dim, a.deltanet

        def add(local: str, shape: tuple[int, ...]) -> None:
            schema.add(key, local, TensorSpec(p + local, shape))

        add("input_layernorm.weight", (H,))
        add("post_attention_layernorm.weight", (H,))
        if linear:
            if a.split_projections or a.split_qkvz:
                add(LIN + "in_proj_qkv.weight", (d.conv_dim, H))
                add(LIN + "in_proj_z.weight", (d.value_dim, H))
            else:
                add(LIN + "in_proj_qkvz.weight", (2 * d.key_dim + 2 * d.value_dim, H))
            if a.split_projections:
                add(LIN + "in_proj_b.weight", (d.num_v_heads, H))
                add(LIN + "in_proj_a.weight", (d.num_v_heads, H))
            else:
                add(LIN + "in_proj_ba.weight", (2 * d.num_v_heads, H))
            add(LIN + "conv1d.weight", (d.conv_dim, 1, d.conv_kernel))
            add(LIN + "dt_bias", (d.num_v_heads,))
            add(LIN + "A_log", (d.num_v_heads,))
            add(LIN + "norm.weight", (d.v_head_dim,))
            add(LIN + "out_proj.weight", (H, d.value_dim))
        else:
            q_out = 2 * s.num_heads * D  # query and output gate, interleaved per head
            for proj, out in (("q", q_out), ("k", s.num_kv_heads * D), ("v", s.num_kv_heads * D)):
                add(f"{ATTN}{proj}_proj.weight", (out, H))
                if a.qkv_bias:
                    add(f"{ATTN}{proj}_proj.bias", (out,))
            add(ATTN + "o_proj.weight", (H, s.num_heads * D))
            if a.o_bias:
                add(ATTN + "o_proj.bias", (H,))
            add(ATTN + "q_norm.weight", (D,))
            add(ATTN + "k_norm.weight", (D,))
        if moe:
            schema.add(key, "router", TensorSpec(f"{p}mlp.gate.weight", (s.num_experts, H)))
            if a.shared_intermediate_size:
                add_gated_mlp(schema, key, f"{p}mlp.shared_expert.", "shared.", a.shared_intermediate_size, H)
                schema.add(key, "shared_gate", TensorSpec(f"{p}mlp.shared_expert_gate.weight", (1, H)))
            add_experts(schema, layer, p, "mlp", s.num_experts, a.moe_intermediate_size, H, a.expert_names,
                        fused_experts)
        else:
            add_gated_mlp(schema, key, f"{p}mlp.", "mlp.", s.intermediate_size, H)


NAMING = HybridNaming("qwen3_next", _args)
