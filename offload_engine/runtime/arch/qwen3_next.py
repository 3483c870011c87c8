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

import dataclasses
from dataclasses import dataclass

import torch

from ...checkpoint.hf_config import ModelSpec, RopeSpec
from ...checkpoint.naming import ModelSchema, TensorSpec, UnitKey
from ...errors import ConfigError
from ..deltanet import DeltaNetDims, GatedDeltaNet
from ..kv_cache import KVCache
from ..layers import Rotary, apply_rotary, attention
from ..linear import linear
from .base import DecoderArgs, StandardDecoder, StandardOps, Weights, add_experts, add_gated_mlp, with_formats
from .qwen2_moe import moe_layers

LINEAR, FULL = "linear_attention", "full_attention"
ATTN, LIN = "self_attn.", "linear_attn."
DEFAULT_ROTARY_FACTOR = 0.25


@dataclass(frozen=True)
class HybridArgs(DecoderArgs):
    layer_types: tuple[str, ...] = ()
    deltanet: DeltaNetDims = DeltaNetDims(1, 1, 1, 1, 1)
    split_projections: bool = False  # Qwen3.5: in_proj_qkv / z / b / a instead of in_proj_qkvz / ba
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


class HybridDecoder(StandardDecoder):
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
            if a.split_projections:
                add(LIN + "in_proj_qkv.weight", (d.conv_dim, H))
                add(LIN + "in_proj_z.weight", (d.value_dim, H))
                add(LIN + "in_proj_b.weight", (d.num_v_heads, H))
                add(LIN + "in_proj_a.weight", (d.num_v_heads, H))
            else:
                add(LIN + "in_proj_qkvz.weight", (2 * d.key_dim + 2 * d.value_dim, H))
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

    def ops(self, a: HybridArgs, device: torch.device, dtype: torch.dtype) -> "HybridOps":
        return HybridOps(a, device, dtype)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by (1 + weight), computed in float32 (transformers' Qwen3NextRMSNorm)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)


def rotary_spec(spec: ModelSpec) -> RopeSpec:
    """transformers defaults partial_rotary_factor to 0.25 for these models when config.json does not say."""
    said = [spec.get("partial_rotary_factor")] + [(spec.get(k) or {}).get("partial_rotary_factor")
                                                  for k in ("rope_parameters", "rope_scaling")]
    if any(v is not None for v in said):
        return spec.rope
    return dataclasses.replace(spec.rope, partial_rotary_factor=DEFAULT_ROTARY_FACTOR)


class HybridOps(StandardOps):
    supports_trees = False  # DeltaNet layers read tokens in order: speculative verifiers must send linear chains

    def __init__(self, a: HybridArgs, device: torch.device, dtype: torch.dtype):
        super().__init__(a, device, dtype)
        self.a: HybridArgs = a
        self.rotary = Rotary(rotary_spec(a.spec), a.spec.head_dim, a.spec.max_position_embeddings, device)
        self.deltanet = GatedDeltaNet(a.deltanet, a.spec.rms_norm_eps)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of the full-attention layers only: linear layers keep a fixed-size state instead."""
        return self.layer_kv_bytes_per_token(itemsize) * len(self.a.full_layers)

    def state_bytes(self, itemsize: int, rollback: int = 0) -> int:
        """Fixed recurrent-state bytes of one sequence (independent of its length): conv states in the compute
        dtype, float32 recurrent states. rollback > 0 adds the most the cache keeps to rewind that many positions
        (two checkpoints and the step logs of up to 3 * rollback positions per linear layer)."""
        d, n = self.a.deltanet, len(self.a.linear_layers)
        live = n * d.state_bytes(itemsize)
        if rollback <= 0:
            return live
        return 3 * live + n * 3 * rollback * d.log_bytes_per_token(itemsize)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, weight, self.s.rms_norm_eps)

    def is_moe(self, layer: int) -> bool:
        """Trunk layers as configured; MTP layers (N + i) are MoE whenever the model has routed experts."""
        return layer in self.a.moe_layers or (layer >= self.s.num_layers and self.s.num_experts > 0)

    def input_norm(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, w["input_layernorm.weight"], self.s.rms_norm_eps)

    def post_norm(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, w["post_attention_layernorm.weight"], self.s.rms_norm_eps)

    def attention(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Full attention or, for linear layers, the Gated DeltaNet (mask: a causal chain only, see deltanet.py)."""
        if self.a.is_linear(layer):
            return self._linear_attention(layer, w, x, cache, mask)
        return self._gated_attention(layer, w, x, positions, cache, mask)

    def _gated_attention(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                         mask: torch.Tensor | None) -> torch.Tensor:
        s, T, D, eps = self.s, x.shape[0], self.s.head_dim, self.s.rms_norm_eps
        qg = linear(x, w, ATTN + "q_proj.weight", ATTN + "q_proj.bias").view(T, s.num_heads, 2 * D)
        q, gate = qg.chunk(2, dim=-1)
        k = linear(x, w, ATTN + "k_proj.weight", ATTN + "k_proj.bias").view(T, s.num_kv_heads, D)
        v = linear(x, w, ATTN + "v_proj.weight", ATTN + "v_proj.bias").view(T, s.num_kv_heads, D)
        q = zero_centered_rms_norm(q, w[ATTN + "q_norm.weight"], eps)
        k = zero_centered_rms_norm(k, w[ATTN + "k_norm.weight"], eps)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all = cache.append(layer, k, v)
        out = attention(q, k_all, v_all, mask, D ** -0.5) * torch.sigmoid(gate.reshape(T, s.num_heads * D))
        return linear(out, w, ATTN + "o_proj.weight", ATTN + "o_proj.bias")

    def _linear_attention(self, layer: int, w: Weights, x: torch.Tensor, cache: KVCache,
                          mask: torch.Tensor | None) -> torch.Tensor:
        mixed, z, b, a = self._projections(w, x)
        out = self.deltanet.forward(layer, cache, mask, mixed, z, b, a, w[LIN + "conv1d.weight"], w[LIN + "A_log"],
                                    w[LIN + "dt_bias"], w[LIN + "norm.weight"])
        return linear(out, w, LIN + "out_proj.weight")

    def _projections(self, w: Weights, x: torch.Tensor):
        """-> mixed q|k|v [T, C] (conv input), z [T, Hv, dv], b [T, Hv], a [T, Hv].

        Qwen3-Next packs the projections per key head: [q (dk) | k (dk) | v (r*dv) | z (r*dv)] and [b (r) | a (r)]
        for each of the Hk key heads, r = Hv / Hk value heads per key head."""
        d, T = self.a.deltanet, x.shape[0]
        if self.a.split_projections:  # Qwen3.5: one projection each, q|k|v already in conv order
            return (linear(x, w, LIN + "in_proj_qkv.weight"),
                    linear(x, w, LIN + "in_proj_z.weight").view(T, d.num_v_heads, d.v_head_dim),
                    linear(x, w, LIN + "in_proj_b.weight"), linear(x, w, LIN + "in_proj_a.weight"))
        r = d.num_v_heads // d.num_k_heads
        qkvz = linear(x, w, LIN + "in_proj_qkvz.weight").view(T, d.num_k_heads, -1)
        q, k, v, z = qkvz.split([d.k_head_dim, d.k_head_dim, r * d.v_head_dim, r * d.v_head_dim], dim=-1)
        b, a = linear(x, w, LIN + "in_proj_ba.weight").view(T, d.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return (mixed, z.reshape(T, d.num_v_heads, d.v_head_dim), b.reshape(T, d.num_v_heads),
                a.reshape(T, d.num_v_heads))


ARCH = HybridDecoder("qwen3_next", _args)
