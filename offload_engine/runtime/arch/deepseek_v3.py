"""DeepSeek-V3 / R1 and Kimi K2 ops: multi-head latent attention (MLA) and grouped sigmoid routing with shared
experts (the naming half, DeepseekV3Args and the tensors: checkpoint/arch/deepseek_v3.py).

MLA caches one compressed latent per token (`c_kv` [T, kv_lora_rank], after kv_a_layernorm) plus one shared roped
key (`k_pe` [T, qk_rope_head_dim]) instead of per-head K/V. Attention either expands the cache through kv_b_proj
(the reference order of operations, cheaper for long prefills) or absorbs kv_b_proj into the query and the output
(cheaper when few queries face a long cache: decode). Multi-token-prediction layers are computed by runtime/mtp.py
with the `mtp_*` ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoint.arch.deepseek_v3 import ATTN, LATENT_NORM_EPS, DeepseekV3Args
from ..kv_cache import KVCache
from ..layers import Rotary, apply_rotary, attention, rms_norm
from ..linear import dense
from .base import StandardOps, Weights, mlp


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
        kv = self.linear(x, w, ATTN + "kv_a_proj_with_mqa.weight", ATTN + "kv_a_proj_with_mqa.bias")
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
        return self.linear(out, w, ATTN + "o_proj.weight", ATTN + "o_proj.bias")

    def _query(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        if self.a.q_lora_rank is None:
            return self.linear(x, w, ATTN + "q_proj.weight")
        q = self.linear(x, w, ATTN + "q_a_proj.weight", ATTN + "q_a_proj.bias")
        return self.linear(rms_norm(q, w[ATTN + "q_a_layernorm.weight"], LATENT_NORM_EPS), w, ATTN + "q_b_proj.weight")

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
        return mlp(w, x, "shared.", self.act, self.kernels)

