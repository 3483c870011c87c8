"""Building blocks shared by the architectures: norms, rotary embeddings, attention, gated MLPs.

Numerics follow transformers' reference implementations (norm in float32, rotate-half RoPE with inv_freq
computed in float32) so that fp32 logits match to rounding.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ..checkpoint.hf_config import RopeSpec, yarn_mscale
from ..errors import ConfigError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ConfigError(f"hidden_act {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalized in float32, rounded to x's dtype, then scaled. F.rms_norm computes the
    same float32 steps (h * rsqrt(mean(h^2) + eps); bit-identical, tests/test_native_kernels.py) in one op
    where the spelled-out form took six."""
    return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps).to(x.dtype)


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return F.linear(act(F.linear(x, gate)) * F.linear(x, up), down)


# ---- rotary embeddings ------------------------------------------------------------------------------------
def rope_inv_freq(rope: RopeSpec, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """inv_freq [dim/2] and the cos/sin attention scaling, per rope type (transformers' modeling_rope_utils)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    base, p = rope.theta, rope.params
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope.rope_type
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    if kind == "freq_factors":  # a GGUF's rope_freqs tensor: llama.cpp divides each frequency by its factor
        return inv_freq / torch.tensor(p["factors"], dtype=torch.float32), 1.0
    raise ConfigError(f"rope type {kind!r} is not supported; supported: default, linear, llama3, yarn")


def _yarn(rope: RopeSpec, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    p, base = rope.params, rope.theta
    orig = float(p["original_max_position_embeddings"])
    factor = p.get("factor") or max_pos / orig
    attn = p.get("attention_factor")
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    if attn is None:
        attn = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)) if (mscale and mscale_all) \
            else yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


class Rotary:
    """cos/sin tables for positions; `apply` rotates the first rotary_dim features (rotate-half layout)."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_position_embeddings: int, device: torch.device):
        inv_freq, self.attention_scaling = rope_inv_freq(rope, head_dim, max_position_embeddings)
        self.inv_freq = inv_freq.to(device)
        self.rotary_dim = 2 * self.inv_freq.numel()
        self._last: tuple | None = None  # positions, dtype, (cos, sin) of the latest call

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # every layer of a forward asks with the same positions tensor (the runtime never writes into one): the
        # tables are made once per forward, ~8 small ops per layer saved; the tensor is held, so `is` cannot
        # mistake a new one for it
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        tables = (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
        self._last = (positions, dtype, tables)
        return tables


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim]; partial rotary leaves the tail untouched."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


# ---- attention --------------------------------------------------------------------------------------------
def causal_mask(q_positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean [T, S]: query at absolute position p sees cache entries 0..p (cache order == position order)."""
    keys = torch.arange(kv_len, device=q_positions.device)
    return keys[None, :] <= q_positions[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; k [S, Hkv, D]; v [S, Hkv, Dv]; mask bool [T, S] -> [T, H * Dv]. GQA by head grouping."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.shape[0] == 1 and q.shape[-1] == v.shape[-1] and bool(mask.all()):
        # one query seeing every entry (a decode step): no mask and grouped heads in place, which lets SDPA take
        # its fused kernel instead of the masked reference path and the K/V copies per head (~20 us a layer)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale,
                                             enable_gqa=heads != kv_heads)
        return out.transpose(0, 1).reshape(1, -1)
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask[None], scale=scale)
    return out.transpose(0, 1).reshape(q.shape[0], -1)
