"""Qwen3-Next and Qwen3.5/3.6-MoE ops: hybrid Gated DeltaNet / gated full attention, routed + shared experts
(the naming half, HybridArgs, layer types and the tensors, with the forward of the MTP layers described:
checkpoint/arch/qwen3_next.py).

Every RMSNorm except the DeltaNet's gated one is zero-centred: x_hat * (1 + weight). Full-attention layers are
Qwen3 attention (QK-norm) whose q_proj also yields a per-head output gate, with partial rotary; linear-attention
layers run runtime/deltanet.py.
"""
from __future__ import annotations

import dataclasses

import torch

from ...checkpoint.arch.qwen3_next import ATTN, DEFAULT_ROTARY_FACTOR, LIN, HybridArgs
from ...checkpoint.hf_config import ModelSpec, RopeSpec
from ..deltanet import GatedDeltaNet
from ..kv_cache import KVCache
from ..layers import Rotary, apply_rotary, attention
from .base import StandardOps, Weights


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

    def attention(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Full attention or, for linear layers, the Gated DeltaNet (mask: a causal chain only, see deltanet.py)."""
        if self.a.is_linear(layer):
            return self._linear_attention(layer, w, x, cache, mask)
        return self._gated_attention(layer, w, x, positions, cache, mask)

    def _gated_attention(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                         mask: torch.Tensor | None) -> torch.Tensor:
        s, T, D, eps = self.s, x.shape[0], self.s.head_dim, self.s.rms_norm_eps
        qg = self.linear(x, w, ATTN + "q_proj.weight", ATTN + "q_proj.bias").view(T, s.num_heads, 2 * D)
        q, gate = qg.chunk(2, dim=-1)
        k = self.linear(x, w, ATTN + "k_proj.weight", ATTN + "k_proj.bias").view(T, s.num_kv_heads, D)
        v = self.linear(x, w, ATTN + "v_proj.weight", ATTN + "v_proj.bias").view(T, s.num_kv_heads, D)
        q = zero_centered_rms_norm(q, w[ATTN + "q_norm.weight"], eps)
        k = zero_centered_rms_norm(k, w[ATTN + "k_norm.weight"], eps)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all = cache.append(layer, k, v)
        out = attention(q, k_all, v_all, mask, D ** -0.5) * torch.sigmoid(gate.reshape(T, s.num_heads * D))
        return self.linear(out, w, ATTN + "o_proj.weight", ATTN + "o_proj.bias")

    def _linear_attention(self, layer: int, w: Weights, x: torch.Tensor, cache: KVCache,
                          mask: torch.Tensor | None) -> torch.Tensor:
        mixed, z, b, a = self._projections(w, x)
        out = self.deltanet.forward(layer, cache, mask, mixed, z, b, a, w[LIN + "conv1d.weight"], w[LIN + "A_log"],
                                    w[LIN + "dt_bias"], w[LIN + "norm.weight"])
        return self.linear(out, w, LIN + "out_proj.weight")

    def _projections(self, w: Weights, x: torch.Tensor):
        """-> mixed q|k|v [T, C] (conv input), z [T, Hv, dv], b [T, Hv], a [T, Hv].

        Qwen3-Next packs the projections per key head: [q (dk) | k (dk) | v (r*dv) | z (r*dv)] and [b (r) | a (r)]
        for each of the Hk key heads, r = Hv / Hk value heads per key head."""
        d, T = self.a.deltanet, x.shape[0]
        if self.a.split_projections:  # Qwen3.5: one projection each, q|k|v already in conv order
            return (self.linear(x, w, LIN + "in_proj_qkv.weight"),
                    self.linear(x, w, LIN + "in_proj_z.weight").view(T, d.num_v_heads, d.v_head_dim),
                    self.linear(x, w, LIN + "in_proj_b.weight"), self.linear(x, w, LIN + "in_proj_a.weight"))
        r = d.num_v_heads // d.num_k_heads
        b, a = self.linear(x, w, LIN + "in_proj_ba.weight").view(T, d.num_k_heads, 2 * r).split([r, r], dim=-1)
        b, a = b.reshape(T, d.num_v_heads), a.reshape(T, d.num_v_heads)
        if self.a.split_qkvz:  # Qwen3-Next's GGUF: q|k|v and z already split as Qwen3.5 has them
            return (self.linear(x, w, LIN + "in_proj_qkv.weight"),
                    self.linear(x, w, LIN + "in_proj_z.weight").view(T, d.num_v_heads, d.v_head_dim), b, a)
        qkvz = self.linear(x, w, LIN + "in_proj_qkvz.weight").view(T, d.num_k_heads, -1)
        q, k, v, z = qkvz.split([d.k_head_dim, d.k_head_dim, r * d.v_head_dim, r * d.v_head_dim], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, d.num_v_heads, d.v_head_dim), b, a

