"""DeepSeek-V3 / R1 and Kimi K2: multi-head latent attention (MLA) and grouped sigmoid routing with shared experts.

MLA caches one compressed latent per token (`c_kv` [T, kv_lora_rank], after kv_a_layernorm) plus one shared roped
key (`k_pe` [T, qk_rope_head_dim]) instead of per-head K/V. Attention either expands the cache through kv_b_proj
(the reference order of operations, cheaper for long prefills) or absorbs kv_b_proj into the query and the output
(cheaper when few queries face a long cache: decode). Multi-token-prediction layers are described by `mtp_schema`
(added to an opened checkpoint when their tensors are present: runtime/mtp.py) and computed by runtime/mtp.py
with the `mtp_*` ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...checkpoint.hf_config import ModelSpec
from ...checkpoint.naming import ModelSchema, TensorSpec, UnitKey
from ...errors import ConfigError
from ..kv_cache import KVCache
from ..layers import Rotary, apply_rotary, attention, rms_norm, yarn_mscale
from ..linear import dense, linear
from .base import (DecoderArgs, StandardDecoder, StandardOps, Weights, add_embed_and_head, add_experts,
                   add_gated_mlp, mlp, with_formats)

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


class DeepseekV3Decoder(StandardDecoder):
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

    def ops(self, a: DeepseekV3Args, device: torch.device, dtype: torch.dtype) -> "DeepseekV3Ops":
        return DeepseekV3Ops(a, device, dtype)


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_interleave: pairs (x0, x1), (x2, x3)... out as [evens | odds]."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DeepseekV3Ops(StandardOps):
    """absorb: None picks per call by estimated cost; True / False force a path (tests, benchmarks)."""

    def __init__(self, a: DeepseekV3Args, device: torch.device, dtype: torch.dtype, absorb: bool | None = None):
        super().__init__(a, device, dtype)
        self.a: DeepseekV3Args = a
        self.rotary = Rotary(a.spec.rope, a.qk_rope_head_dim, a.spec.max_position_embeddings, device)
        self.absorb = absorb

    def layer_kv_bytes_per_token(self, itemsize: int) -> int:
        """The latent and the rope key: far less than per-head K/V."""
        return (self.a.kv_lora_rank + self.a.qk_rope_head_dim) * itemsize

    def attention(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor | None) -> torch.Tensor:
        a, T = self.a, x.shape[0]
        q = self._query(w, x).view(T, self.s.num_heads, a.qk_head_dim)
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        kv = linear(x, w, ATTN + "kv_a_proj_with_mqa.weight", ATTN + "kv_a_proj_with_mqa.bias")
        c_kv, k_pe = kv.split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        c_kv = rms_norm(c_kv, w[ATTN + "kv_a_layernorm.weight"], LATENT_NORM_EPS)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        rope = rotary_interleaved if a.rope_interleave else apply_rotary
        q_pe, k_pe = rope(q_pe, cos, sin), rope(k_pe[:, None, :], cos, sin)[:, 0]
        c_all, pe_all = cache.append(layer, c_kv, k_pe)
        kv_b = dense(w, ATTN + "kv_b_proj.weight", x.dtype)
        if self.absorb if self.absorb is not None else self._absorb_is_cheaper(T):
            out = self._absorbed(q_nope, q_pe, c_all, pe_all, kv_b, mask)
        else:
            out = self._expanded(q_nope, q_pe, c_all, pe_all, kv_b, mask)
        return linear(out, w, ATTN + "o_proj.weight", ATTN + "o_proj.bias")

    def _query(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        if self.a.q_lora_rank is None:
            return linear(x, w, ATTN + "q_proj.weight")
        q = linear(x, w, ATTN + "q_a_proj.weight", ATTN + "q_a_proj.bias")
        return linear(rms_norm(q, w[ATTN + "q_a_layernorm.weight"], LATENT_NORM_EPS), w, ATTN + "q_b_proj.weight")

    def _absorb_is_cheaper(self, queries: int) -> bool:
        """Per cached position and head: expanding costs r*(n+v) once plus T*(n+p+v); absorbing T*(2r+p)."""
        a = self.a
        n, v, r = a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
        return queries * (2 * r - n - v) < r * (n + v)

    def _expanded(self, q_nope, q_pe, c_all, pe_all, kv_b, mask) -> torch.Tensor:
        """The reference path: per-head K/V for every cached position, then standard attention."""
        a, S, heads = self.a, c_all.shape[0], q_nope.shape[1]
        kv = F.linear(c_all, kv_b).view(S, heads, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        k = torch.cat([k_nope, pe_all[:, None, :].expand(S, heads, a.qk_rope_head_dim)], dim=-1)
        return attention(torch.cat([q_nope, q_pe], dim=-1), k, v, mask, a.softmax_scale)

    def _absorbed(self, q_nope, q_pe, c_all, pe_all, kv_b, mask) -> torch.Tensor:
        """Attention in latent space: q_nope @ W_uk against c_kv, then W_uv applied to the latent output."""
        a, T, heads = self.a, q_nope.shape[0], q_nope.shape[1]
        w_kv = kv_b.view(heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
        w_uk, w_uv = w_kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=1)
        q_lat = torch.einsum("thn,hnr->htr", q_nope, w_uk)
        scores = (q_lat @ c_all.T + q_pe.transpose(0, 1) @ pe_all.T) * a.softmax_scale  # [heads, T, S]
        if mask is not None:
            scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(c_all.dtype)
        return torch.einsum("htr,hvr->thv", probs @ c_all, w_uv).reshape(T, heads * a.v_head_dim)

    # feed-forward
    def route(self, layer: int, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid scores; the correction bias steers selection only; group-limited top-k (noaux_tc)."""
        a, E, k = self.a, self.s.num_experts, self.s.num_experts_per_tok
        scores = F.linear(x.float(), dense(w, "mlp.gate.weight", torch.float32).float()).sigmoid()
        choice = scores + w["mlp.gate.e_score_correction_bias"].float()
        if a.topk_group < a.n_group:  # keep the topk_group groups with the best sum of their top-2 choice scores
            groups = choice.view(-1, a.n_group, E // a.n_group)
            group_idx = groups.topk(2, dim=-1)[0].sum(dim=-1).topk(a.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros(groups.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, group_idx, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // a.n_group, dim=1), float("-inf"))
        indices = choice.topk(k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        if a.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, weights * a.routed_scaling_factor

    def router_scores(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor:
        """Selection scores (sigmoid + correction bias) for lookahead prefetching; group limits ignored."""
        scores = F.linear(x.float(), dense(w, "mlp.gate.weight", torch.float32).float()).sigmoid()
        return scores + w["mlp.gate.e_score_correction_bias"].float()

    def shared_experts(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor | None:
        if not self.a.n_shared_experts:
            return None
        return mlp(w, x, "shared.", self.act)


ARCH = DeepseekV3Decoder("deepseek_v3", _args)
