"""The ops half of an architecture: the per-layer operations the runtime calls, built from the args its naming
half (checkpoint/arch/) parsed. The runtime owns the layer loop, residuals and weight acquisition; the ops only
compute.

`StandardOps` computes Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE: they differ only in the flags of
their DecoderArgs (QKV bias, QK-norm, which layers are MoE, shared experts).
"""
from __future__ import annotations

import copy
from typing import Mapping, Protocol

import torch

from ...checkpoint.arch.base import DecoderArgs
from ..kv_cache import KVCache
from ..layers import Rotary, activation, apply_rotary, attention, gated_mlp, rms_norm
from ..kernels.int_experts import IntExpert, int_expert
from ..kernels.decode import DecodeKernels
from ..kernels.select import W, fast_linear
from ..linear import dense, embedding, is_quantized, linear, linears
from ..moe import softmax_topk
from ..per_fill import PerFill

Weights = Mapping[str, torch.Tensor]


class LayerOps(Protocol):
    """What the runtime calls for one model; `w` is always the tensors of one unit, by local name. `kernels`: the
    native decode kernels the ops compute with (None: torch's ops), fixed per ops object (`with_kernels`)."""

    kernels: DecodeKernels | None

    def with_kernels(self, kernels: DecodeKernels | None) -> "LayerOps": ...

    def kv_bytes_per_token(self, itemsize: int) -> int: ...
    def layer_kv_bytes_per_token(self, itemsize: int) -> int: ...
    def state_bytes(self, itemsize: int, rollback: int = 0) -> int: ...
    def embed(self, w: Weights, tokens: torch.Tensor) -> torch.Tensor: ...
    def logits(self, w: Weights, x: torch.Tensor) -> torch.Tensor: ...
    def input_norm(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor: ...
    def post_norm(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor: ...
    def attention(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor | None) -> torch.Tensor: ...
    def is_moe(self, layer: int) -> bool: ...
    def dense_mlp(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor: ...
    def route(self, layer: int, w: Weights, x: torch.Tensor, logits: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def decode_block(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                     mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None: ...
    def router_scores(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor: ...
    def shared_experts(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor | None: ...
    def expert(self, w: Weights, x: torch.Tensor) -> torch.Tensor: ...


def mlp(w: Weights, x: torch.Tensor, prefix: str, act, kernels: DecodeKernels | None = None) -> torch.Tensor:
    """The gated MLP of weights `<prefix>gate`, `<prefix>up`, `<prefix>down` (any stored format: linear() takes
    each product's fastest path, runtime/kernels/select.py and decode.py)."""
    h = act(linear(x, w, prefix + "gate", kernels=kernels)) * linear(x, w, prefix + "up", kernels=kernels)
    return linear(h, w, prefix + "down", kernels=kernels)


def expert_forward(w: Weights, x: torch.Tensor, act, kernels: DecodeKernels | None = None) -> torch.Tensor:
    if "gate_up" in w:
        gate, up = w["gate_up"].chunk(2, dim=0)
        return gated_mlp(x, gate, up, w["down"], act)
    if is_quantized(w, "gate_up"):
        fused = fast_linear(x, w, "gate_up")
        if fused is None:  # dequantized: gate and up multiplied apart, as for plain weights
            gate, up = dense(w, "gate_up", x.dtype).chunk(2, dim=0)
            return gated_mlp(x, gate, up, dense(w, "down", x.dtype), act)
        gate, up = fused.chunk(2, dim=-1)
        return linear(act(gate) * up, w, "down", kernels=kernels)
    return mlp(w, x, "", act, kernels=kernels)


QKV_WEIGHTS = [f"self_attn.{p}_proj.weight" for p in "qkv"]
QKV_BIASES = [f"self_attn.{p}_proj.bias" for p in "qkv"]


class StandardOps:
    def __init__(self, a: DecoderArgs, device: torch.device, dtype: torch.dtype):
        self.a, self.s = a, a.spec
        self.act = activation(self.s.hidden_act)
        self.rotary = Rotary(self.s.rope, self.s.head_dim, self.s.max_position_embeddings, device)
        self.dtype = dtype
        self._expert_forms: PerFill = PerFill()  # gated_silu's answer per expert unit fill
        self._block_forms: PerFill = PerFill()  # decode_block's weights per dense unit fill
        self._standard_block = self.keeps_standard_block()
        self.kernels: DecodeKernels | None = None  # the native decode kernels every product takes (with_kernels)

    def with_kernels(self, kernels: DecodeKernels | None) -> "StandardOps":
        """These ops (the same rotary tables and per-fill caches) computing with `kernels`: a decode step's products
        and norms by the native kernels chosen for their shapes (runtime/kernels/decode.py); None: torch's ops."""
        bound = copy.copy(self)
        bound.kernels = kernels
        return bound

    def linear(self, x: torch.Tensor, w: Weights, name: str, bias: str | None = None) -> torch.Tensor:
        """runtime/linear.py's linear() with these ops' kernels."""
        return linear(x, w, name, bias, self.kernels)

    @classmethod
    def keeps_standard_block(cls) -> bool:
        """Whether the class keeps StandardOps' own norm, attention and routing: what decode_block composes (a
        subclass with its own has none)."""
        return all(getattr(cls, name) is getattr(StandardOps, name)
                   for name in ("norm", "input_norm", "post_norm", "attention", "route"))

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Every layer's cache entry for one position (what the KV cache stores)."""
        return self.layer_kv_bytes_per_token(itemsize) * self.s.num_layers

    def layer_kv_bytes_per_token(self, itemsize: int) -> int:
        """One attention layer's entry for one position: K and V (an MTP layer's own cache holds this too)."""
        return 2 * self.s.num_kv_heads * self.s.head_dim * itemsize

    def state_bytes(self, itemsize: int, rollback: int = 0) -> int:
        """Fixed per-sequence recurrent state (linear-attention layers); none for pure attention models."""
        return 0

    # embedding and head
    def embed(self, w: Weights, tokens: torch.Tensor) -> torch.Tensor:
        return embedding(w, "weight", tokens, self.dtype)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The architecture's RMSNorm (zero-centred variants override this); a decode step's rows by the native
        kernel where it is on."""
        kernels = self.kernels
        out = kernels.rms_norm(x, weight, self.s.rms_norm_eps) if kernels is not None else None
        return rms_norm(x, weight, self.s.rms_norm_eps) if out is None else out

    def logits(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        return self.head_logits(w, self.final_norm(w, x))

    def final_norm(self, head: Weights, x: torch.Tensor) -> torch.Tensor:
        """The model's final norm (the head unit's `norm`); MTP layers consume the normalized trunk output."""
        return self.norm(x, head["norm"])

    def head_logits(self, head: Weights, x: torch.Tensor) -> torch.Tensor:
        """The head without the final norm (MTP outputs are already normalized)."""
        return self.linear(x, head, "weight").float()

    # multi-token prediction (w: one `mtp` unit). Local names shared by the formats that have MTP layers (DeepSeek:
    # enorm, hnorm, eh_proj, shared_head.norm; Qwen: pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm); the
    # formula is the same: the embedding first, then the previous depth's hidden state.
    def mtp_input(self, w: Weights, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """proj([embed_norm(emb(t_p)); hidden_norm(h_{p-1})])."""
        joined = torch.cat([self.norm(embedded, w["mtp.embed_norm"]), self.norm(hidden, w["mtp.hidden_norm"])], -1)
        return self.linear(joined, w, "mtp.proj")

    def mtp_output(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        """The block's output after the MTP layer's own norm: what the head scores and the next depth consumes."""
        return self.norm(x, w["mtp.out_norm"])

    def input_norm(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, w["input_layernorm.weight"])

    def post_norm(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, w["post_attention_layernorm.weight"])

    def attention(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor | None) -> torch.Tensor:
        out = self._native_step(layer, w, x, positions, cache, mask)
        if out is None:
            q, k_all, v_all = self.project_qkv(layer, w, x, positions, cache)
            out = attention(q, k_all, v_all, mask, self.s.head_dim ** -0.5)
        return self.linear(out, w, "self_attn.o_proj.weight", "self_attn.o_proj.bias")

    def _native_step(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                     mask: torch.Tensor | None) -> torch.Tensor | None:
        """A one-token decode step's attention between the projections in one native call (QK-norm, RoPE, the
        cache write, attention over every position: kernels/native/decode_cpu.cpp) where `one_row_buffers`
        allows it; None otherwise (the torch path)."""
        kernels = self.kernels
        buffers = self.one_row_buffers(kernels, layer, x, positions, cache, mask)
        if buffers is None:
            return None
        q, k, v = linears(x, w, QKV_WEIGHTS, QKV_BIASES, self.kernels)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return kernels.module.attend_one(q.contiguous(), k.contiguous(), v.contiguous(), *self._qk_norms(w),
                                         self.s.rms_norm_eps, cos, sin, *buffers, cache.length,
                                         self.s.head_dim ** -0.5)

    def one_row_buffers(self, kernels, layer: int, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                         mask: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
        """The layer's cache buffers a native one-token step writes its entry into, where the native kernels are on,
        the step is bf16 on the CPU, sees every cached position and the cache stores bf16 as given; else None.
        Architectures with their own norm or attention never get here."""
        s = self.s
        if (kernels is None or x.shape[0] != 1 or x.dtype is not torch.bfloat16 or x.device.type != "cpu"
                or type(self).norm is not StandardOps.norm or self.rotary.rotary_dim != s.head_dim
                or (mask is not None and not bool(mask.all()))):
            return None
        buffers = cache.plain_buffers(layer, x.dtype)
        return None if buffers is None or int(positions[0]) != cache.length else buffers

    def _qk_norms(self, w: Weights) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (w["self_attn.q_norm.weight"], w["self_attn.k_norm.weight"]) if self.a.qk_norm else (None, None)

    def decode_block(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                     mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """A one-token step's attention block in one native call (kernels/native/layer_cpu.cpp): x + attention of
        input_norm(x), its post_norm, and on a MoE layer the router's logits. It makes the calls attention(),
        post_norm() and route()'s product make, in their order, so the bits are theirs; what it saves is ~150 us
        of Python a layer. None where one of them would not take a native kernel: the caller then runs them."""
        kernels = self.kernels
        if not self._standard_block:
            return None
        buffers = self.one_row_buffers(kernels, layer, x, positions, cache, mask)
        forms = None if buffers is None else self.block_forms(kernels, layer, w)
        if forms is None:
            return None
        input_norm, post_norm, qkv, q_norm, k_norm, o_proj, router = forms
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        s = self.s
        out, h, logits = kernels.module.attention_block(x.contiguous(), input_norm, post_norm, s.rms_norm_eps, qkv,
                                                        q_norm, k_norm, cos, sin, *buffers, cache.length,
                                                        s.head_dim ** -0.5, o_proj, router)
        return out, h, logits if router else None

    def block_forms(self, kernels, layer: int, w: Weights) -> tuple | None:
        """decode_block's weights of `layer` (its dense unit `w`), resolved once per fill of the unit: (input norm,
        post norm, [q, k, v forms], q norm, k norm, o_proj form, router form or []); None where the block is not
        this class's or a weight takes another path."""
        anchor = w.get(QKV_WEIGHTS[0], w.get(QKV_WEIGHTS[0] + W))
        if not self._standard_block or anchor is None:
            return None
        return self._block_forms.get(anchor, lambda: self._block_forms_of(kernels, layer, w))

    def _block_forms_of(self, kernels, layer: int, w: Weights) -> tuple | None:
        """decode_block's weights as the native kernels take them (DecodeKernels.form), or None where one has a
        bias or takes torch's path, or q, k and v do not share one kernel (DecodeKernels.linears would split)."""
        names = [*QKV_WEIGHTS, "self_attn.o_proj.weight"] + (["router"] if self.is_moe(layer) else [])
        if any(w.get(bias) is not None for bias in (*QKV_BIASES, "self_attn.o_proj.bias")):
            return None
        forms = [kernels.form(w, name) for name in names]
        norms = [w.get("input_layernorm.weight"), w.get("post_attention_layernorm.weight")]
        if None in forms or any(n is None or n.dtype is not torch.bfloat16 or not n.is_contiguous() for n in norms):
            return None
        if len({len(f) == 1 for f in forms[:3]}) != 1:  # plain and int mixed
            return None
        return (*norms, forms[:3], *self._qk_norms(w), forms[3], forms[4] if len(forms) > 4 else [])

    def project_qkv(self, layer: int, w: Weights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """GQA projections (with their biases and QK-norm where the unit has them), roped, this forward's keys
        and values appended to the cache: the queries and every cached key and value."""
        s, T, D = self.s, x.shape[0], self.s.head_dim
        q = self.linear(x, w, "self_attn.q_proj.weight", "self_attn.q_proj.bias").view(T, s.num_heads, D)
        k = self.linear(x, w, "self_attn.k_proj.weight", "self_attn.k_proj.bias").view(T, s.num_kv_heads, D)
        v = self.linear(x, w, "self_attn.v_proj.weight", "self_attn.v_proj.bias").view(T, s.num_kv_heads, D)
        if self.a.qk_norm:
            q = rms_norm(q, w["self_attn.q_norm.weight"], s.rms_norm_eps)
            k = rms_norm(k, w["self_attn.k_norm.weight"], s.rms_norm_eps)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all = cache.append(layer, k, v)
        return q, k_all, v_all

    # feed-forward
    def is_moe(self, layer: int) -> bool:
        return layer in self.a.moe_layers

    def dense_mlp(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor:
        return mlp(w, x, "mlp.", self.act, self.kernels)

    def route(self, layer: int, w: Weights, x: torch.Tensor, logits: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [T, k], weights [T, k]) of x; `logits`: the router's product of x, where decode_block made it."""
        if logits is None:
            logits = self.linear(x, w, "router")
        return softmax_topk(logits, self.s.num_experts_per_tok, self.a.norm_topk_prob)

    def router_scores(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor:
        """Selection scores [T, E] (higher = more likely routed): what lookahead prefetching ranks by."""
        return torch.softmax(self.linear(x, w, "router"), dim=-1, dtype=torch.float32)

    def shared_experts(self, layer: int, w: Weights, x: torch.Tensor) -> torch.Tensor | None:
        if not self.a.shared_intermediate_size:
            return None
        y = mlp(w, x, "shared.", self.act, self.kernels)
        return torch.sigmoid(self.linear(x, w, "shared_gate")) * y

    def expert(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        return expert_forward(w, x, self.act, self.kernels)

    def gated_silu(self, w: Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | IntExpert | None:
        """A routed expert's plain (gate, up, down), or its int8 / int4 kernel forms (IntExpert), where `expert`
        computes it as down(silu(gate x) * up x): what the native grouped kernels take (runtime/kernels/decode.py);
        None for other quantized units or another activation. Computed once per fill of the unit's slot."""
        if self.s.hidden_act not in ("silu", "swish"):
            return None
        anchor = w.get("down", w.get("down" + W))
        return None if anchor is None else self._expert_forms.get(anchor, lambda: self._gated_silu(w))

    def _gated_silu(self, w: Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | IntExpert | None:
        if "down" not in w:
            return int_expert(w)
        if "gate_up" in w:
            mats = (*w["gate_up"].chunk(2, dim=0), w["down"])
        elif "gate" in w and "up" in w:
            mats = (w["gate"], w["up"], w["down"])
        else:
            return None
        # the kernel takes bf16 rows laid out contiguously; anything else (another dtype) stays on torch's path
        return mats if all(m.dtype == torch.bfloat16 and m.dim() == 2 and m.stride(1) == 1 for m in mats) else None
