"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5/3.6: causal conv, chunked prefill, recurrent decode.

Glossary (per linear-attention layer; Hk/Hv key/value heads, dk/dv head dims, C = 2*Hk*dk + Hv*dv, K conv width):
  conv state       the last K-1 rows of the conv's input [K-1, C], in the compute dtype
  recurrent state  S [Hv, dk, dv], float32 (as transformers and the releases' `mamba_ssm_dtype`): per token,
                   S <- exp(g) * S;  S <- S + k (beta * (v - S^T k))^T;  out = S^T q
  step log         for each position of a rewindable forward, what the recurrence consumed (conv input row,
                   normalized k, v, g, beta). Replaying it from an earlier state rebuilds a later one bit for bit,
                   which is how `KVCache.trim` rewinds these layers (see kv_cache.py).

Kernel choice: a forward that starts a sequence, or is longer than the cache's rollback window, runs the chunked
rule (transformers' prefill path); any other forward (decode, a speculative chain) runs the recurrent rule token
by token, the order transformers' decode uses, and logs its steps. A draft *tree* cannot be honoured by a
recurrence, so a non-causal mask is refused: speculative verifiers send linear chains to hybrid models.

Numerics mirror transformers' torch fallbacks (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule,
causal_conv1d_fn/update), so fp32 logits match to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checkpoint.arch.qwen3_next import DeltaNetDims
from .kv_cache import KVCache

CHUNK = 64  # transformers' chunk size for the chunked rule
L2_EPS = 1e-6  # l2norm epsilon of the reference (and FLA)

State = tuple[torch.Tensor, torch.Tensor]  # (conv state [K-1, C], recurrent state [Hv, dk, dv] float32)


# ---- pieces ---------------------------------------------------------------------------------------------
def causal_conv(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [T, C]; state [K-1, C] or None (zeros); weight [C, 1, K].

    Returns (out [T, C], the new conv state [K-1, C])."""
    k, length = weight.shape[-1], x.shape[0]
    if state is None:
        state = x.new_zeros((k - 1, x.shape[1]))
    full = torch.cat([state.to(x.dtype), x], dim=0)  # [K-1+T, C]
    taps = weight[:, 0, :].to(torch.float32)  # [C, K]; a K-term sum per channel, accumulated in float32
    out = full[:length].to(torch.float32) * taps[:, 0]
    for j in range(1, k):
        out = out + full[j:j + length].to(torch.float32) * taps[:, j]
    return F.silu(out.to(weight.dtype)).to(x.dtype), full[full.shape[0] - (k - 1):].clone()


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm before gate: weight * rmsnorm(x) * silu(gate), in float32 (transformers' RMSNormGated)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.to(torch.float32))).to(dtype)


def delta_step(s: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
               ) -> torch.Tensor:
    """One token of the gated delta rule. s [H, dk, dv]; k [H, dk]; v [H, dv]; g, beta [H]. Returns a new state.

    Both the recurrent kernel and the rewind replay go through this one function, so a replayed state equals the
    state the forward produced, bit for bit."""
    s = s * g.exp()[:, None, None]
    kv_mem = (s * k[:, :, None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[:, None]
    return s + k[:, :, None] * delta[:, None, :]


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k [H, T, dk] (normalized); v [H, T, dv]; g, beta [H, T]; all float32.

    Returns (out [H, T, dv], final state [H, dk, dv])."""
    heads, length, dk = k.shape
    q = q / (dk ** 0.5)
    s = torch.zeros((heads, dk, v.shape[-1]), dtype=v.dtype, device=v.device) if state is None else state.to(v)
    out = torch.zeros_like(v)
    for i in range(length):
        s = delta_step(s, k[:, i], v[:, i], g[:, i], beta[:, i])
        out[:, i] = (s * q[:, i, :, None]).sum(dim=-2)
    return out, s


def chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor | None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) form, same arguments and results as `recurrent_rule`.

    Within a chunk the delta-rule updates are solved as one unit-triangular system; chunks are scanned in order."""
    heads, length, dk = k.shape
    dv = v.shape[-1]
    q = q * dk ** -0.5
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (length + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(heads, n, chunk).cumsum(dim=-1)  # log of the decay from the chunk start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # decay j -> i, i >= j
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)
    s = torch.zeros((heads, dk, dv), dtype=v.dtype, device=v.device) if state is None else state.to(v)
    out = torch.zeros_like(new_values)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(n):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, n * chunk, dv)[:, :length], s


# ---- the layer's token mixer -----------------------------------------------------------------------------
class GatedDeltaNet:
    """The part of a linear-attention layer between the input projections and out_proj, with its cache state.

    `forward` reads the committed state from the cache, computes, and records the new state (and, for rewindable
    forwards, the step log) for `KVCache.advance` to commit. `replay` is handed to the cache for rewinds."""

    def __init__(self, dims: DeltaNetDims, eps: float):
        self.dims, self.eps = dims, eps

    def forward(self, layer: int, cache: KVCache, mask: torch.Tensor | None, mixed_qkv: torch.Tensor,
                z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        """mixed_qkv [T, C] (q | k | v, before the conv); z [T, Hv, dv]; b, a [T, Hv] -> [T, Hv * dv]."""
        d, length = self.dims, mixed_qkv.shape[0]
        _require_chain(mask, length)
        state = cache.state(layer)
        x, conv_state = causal_conv(mixed_qkv, None if state is None else state[0], conv_weight)
        q, k, v = x.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        beta = b.sigmoid()
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
        q, k, v, g, beta = self._prepare(q, k, v, g, beta)
        recurrent = state is not None and (length == 1 or length <= cache.rollback)
        rule = recurrent_rule if recurrent else chunk_rule
        out, s = rule(q, k, v, g, beta, None if state is None else state[1])
        log = None
        if recurrent and cache.rollback > 0:
            log = (mixed_qkv, k.transpose(0, 1), v.transpose(0, 1), g.T, beta.T)
        cache.set_state(layer, (conv_state, s), log=log, replay=self.replay)
        out = out.transpose(0, 1).to(mixed_qkv.dtype)  # [T, Hv, dv]
        return rms_norm_gated(out, z, norm_weight, self.eps).reshape(length, d.value_dim)

    def _prepare(self, q, k, v, g, beta):
        """[T, ...] -> per-head float32 [Hv, T, ...]; q and k normalized, key heads shared by value-head groups."""
        d, length = self.dims, q.shape[0]
        q = q.reshape(length, d.num_k_heads, d.k_head_dim)
        k = k.reshape(length, d.num_k_heads, d.k_head_dim)
        v = v.reshape(length, d.num_v_heads, d.v_head_dim)
        if d.num_v_heads != d.num_k_heads:  # value head i reads key head i // r (grouped) or i % Hk (tiled)
            r = d.num_v_heads // d.num_k_heads
            q, k = ((t.repeat(1, r, 1) if d.v_heads_tiled else t.repeat_interleave(r, dim=1)) for t in (q, k))
        q, k, v, beta, g = (t.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
                            for t in (q, k, v, beta, g))
        return l2norm(q), l2norm(k), v, g, beta

    def replay(self, state: State | None, log: tuple[torch.Tensor, ...]) -> State:
        """The state after the logged positions ([n, ...] each), starting from `state` (None: a fresh sequence)."""
        d = self.dims
        rows, k, v, g, beta = log
        if state is None:
            state = (rows.new_zeros((d.conv_kernel - 1, d.conv_dim)),
                     torch.zeros((d.num_v_heads, d.k_head_dim, d.v_head_dim), dtype=torch.float32,
                                 device=rows.device))
        conv, s = state
        full = torch.cat([conv, rows], dim=0)
        for i in range(rows.shape[0]):
            s = delta_step(s, k[i], v[i], g[i], beta[i])
        return full[full.shape[0] - (d.conv_kernel - 1):].clone(), s


def _require_chain(mask: torch.Tensor | None, length: int) -> None:
    """A recurrence reads tokens in order: the new tokens must form a causal chain over the whole cache."""
    if mask is None or length == 1:
        return
    new = mask[:, mask.shape[1] - length:]
    chain = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    if not (torch.equal(new, chain) and bool(mask[:, :mask.shape[1] - length].all())):
        raise ValueError("linear-attention (Gated DeltaNet) layers need the new tokens as one causal chain after "
                         "the whole cache; draft trees are not supported for hybrid models: send a linear chain")
