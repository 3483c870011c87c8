"""gpt-oss ops (the naming half, GptOssArgs and the tensors: checkpoint/arch/gpt_oss.py), as transformers'
modeling_gpt_oss computes them:

  attention   biased GQA with YaRN rope; each head's learned sink joins the softmax as one more logit whose
              probability is dropped (attention may put weight on nothing); sliding layers see only the last
              `sliding_window` positions. The cache keeps every position for every layer (a full-size cache for
              the sliding layers too: simpler, and exact; a ring buffer would save (L/2) * (S - W) positions).
  router      logits = x W^T + b; top-k on the logits, softmax over the k chosen
  experts     gate_up = x W_gu + b (2I outputs, gate even, up odd; a GGUF holds gate and up apart); gate clamped above at `limit`, up to
              [-limit, limit]; (up + 1) * gate * sigmoid(alpha * gate); then x W_down + b
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoint.arch.gpt_oss import GptOssArgs
from ..kv_cache import KVCache
from ..linear import dense
from .base import StandardOps, Weights


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         sinks: torch.Tensor) -> torch.Tensor:
    """q [T, H, D]; k, v [S, Hkv, D]; mask bool [T, S]; sinks [H] -> [T, H * D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, q.shape[0], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("hts,shd->thd", probs.to(v.dtype), v).reshape(q.shape[0], -1)


class GptOssOps(StandardOps):
    def __init__(self, a: GptOssArgs, device: torch.device, dtype: torch.dtype):
        super().__init__(a, device, dtype)
        self.a: GptOssArgs = a

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The weight multiplies in float32 before the cast back (GptOssRMSNorm)."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.s.rms_norm_eps)
        return (weight.to(torch.float32) * h).to(x.dtype)

    def attention(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor | None) -> torch.Tensor:
        q, k_all, v_all = self.project_qkv(layer, w, x, positions, cache)
        if self.a.is_sliding(layer):
            mask = mask & self._window(positions, k_all.shape[0])
        out = attention_with_sinks(q, k_all, v_all, mask, self.s.head_dim ** -0.5, w["self_attn.sinks"])
        return self.linear(out, w, "self_attn.o_proj.weight", "self_attn.o_proj.bias")

    def _window(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[T, S]: keys within each query's window (transformers: key position > query position - window). The
        committed entries sit at positions 0..S-T-1 (cache order), this forward's at `positions` (a draft tree's
        nodes may share one)."""
        T = positions.shape[0]
        keys = torch.cat([torch.arange(kv_len - T, device=positions.device), positions])
        return keys[None, :] > positions[:, None] - self.a.sliding_window

    def route(self, layer: int, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.linear(x, w, "mlp.router.weight", "mlp.router.bias")
        top, idx = torch.topk(logits, self.s.num_experts_per_tok, dim=-1)
        return idx, torch.softmax(top, dim=-1, dtype=top.dtype)

    def router_scores(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(x, w, "mlp.router.weight", "mlp.router.bias"), dim=-1, dtype=torch.float32)

    def shared_experts(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def gated_silu(self, w: Weights) -> None:
        """gpt-oss's experts are a clamped, biased SwiGLU over interleaved gate/up columns: not the native kernel's."""
        return None

    def expert(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        if "gate_bias" in w:  # a GGUF's: gate_up split by llama.cpp's converter (checkpoint/gguf/gpt_oss.py)
            gate, up = self.linear(x, w, "gate", "gate_bias"), self.linear(x, w, "up", "up_bias")
        else:
            if "gate_up_t" in w:  # bf16 as transformers saves it: [in, out]
                gate_up = x @ w["gate_up_t"] + w["gate_up_bias"]
            else:  # MXFP4 (any quantized format): [out, in]
                gate_up = F.linear(x, dense(w, "gate_up", x.dtype), w["gate_up_bias"])
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        limit = self.a.swiglu_limit
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        hidden = (up + 1) * (gate * torch.sigmoid(gate * self.a.swiglu_alpha))
        if "down_t" in w:
            return hidden @ w["down_t"] + w["down_bias"]
        return F.linear(hidden, dense(w, "down", x.dtype), w["down_bias"])
