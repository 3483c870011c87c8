"""The layer loop: embeddings, decoder layers, head, with weights asked for unit by unit."""
from __future__ import annotations

import torch

from ..checkpoint.model import ModelCheckpoint
from ..checkpoint.naming import UnitKey
from ..errors import BudgetError, out_of_memory_as_error
from .kv_cache import KVCache
from .layers import causal_mask
from .moe import combine, expert_part, routed_experts
from .weights import Weights, WeightSource, hold, lookup


class CausalLM:
    """forward(tokens, cache) -> float32 logits; the architecture computes, the source supplies weights."""

    def __init__(self, checkpoint: ModelCheckpoint, source: WeightSource, device: torch.device, dtype: torch.dtype,
                 max_context: int | None = None):
        self.checkpoint = checkpoint
        self.spec = checkpoint.spec
        self.source = source
        self.device, self.dtype = device, dtype
        self.ops = checkpoint.arch.ops(checkpoint.args, device, dtype)
        self.vocab_size = self.spec.vocab_size
        self.num_layers = self.spec.num_layers
        self.max_context = max_context  # the KV cache reserved in the budget holds this many positions
        self.prefetcher = None  # prefetch.Prefetcher, set by the engine when weights stream
        self.routing_trace: list[tuple[int, list[list[int]]]] | None = None  # set to [] to record routing

    def new_cache(self, max_tokens: int) -> KVCache:
        if self.max_context is not None and max_tokens > self.max_context:
            raise BudgetError("kv-cache", max_tokens, self.max_context,
                              hint="prompt + max_new_tokens exceed the context reserved; pass a larger max_context")
        return KVCache(self.num_layers, max_tokens, self.device)

    def _unit(self, key: UnitKey):
        return hold(self.source, key)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, last_only: bool = False, return_hidden: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [T] follow the cache's committed content; mask [T, cache.length + T] for draft trees.

        return_hidden: also return the last decoder layer's output before the final norm [T, H] (what MTP
        heads consume). An allocator out-of-memory error (KV cache, activations, a weight copy) fails this
        call with a DeviceOOMError; the cache is not advanced, so the request can be retried or dropped."""
        with out_of_memory_as_error(f"forward pass on {self.device}"):
            return self._forward(tokens, cache, positions, mask, last_only, return_hidden)

    def _forward(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None,
                 mask: torch.Tensor | None, last_only: bool, return_hidden: bool
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        tokens = tokens.to(self.device)
        T = tokens.shape[0]
        if positions is None:
            positions = torch.arange(cache.length, cache.length + T, device=self.device)
        if mask is None:
            mask = causal_mask(positions, cache.length + T)
        ops = self.ops
        x = lookup(self.source, UnitKey(-1, "embed"), tokens, ops.embed)
        prefetcher = self.prefetcher
        for layer in range(self.num_layers):
            with self._unit(UnitKey(layer, "dense")) as w:
                x = x + ops.attention(layer, w, ops.input_norm(layer, w, x), positions, cache, mask)
                if prefetcher is not None:  # reads for the next layers start while this one computes
                    prefetcher.after_attention(layer, x)
                h = ops.post_norm(layer, w, x)
                if ops.is_moe(layer):
                    x = x + self._moe(layer, w, h)
                else:
                    x = x + ops.dense_mlp(layer, w, h)
        if last_only:
            x = x[-1:]
        with self._unit(UnitKey(self.num_layers, "head")) as w:
            logits = ops.logits(w, x)
        cache.advance(T)
        return (logits, x) if return_hidden else logits

    def _moe(self, layer: int, w: Weights, h: torch.Tensor) -> torch.Tensor:
        indices, weights = self.ops.route(layer, w, h)
        experts = routed_experts(indices, weights)
        if self.routing_trace is not None:
            self.routing_trace.append((layer, indices.tolist()))
        if self.prefetcher is not None:
            self.prefetcher.routed(layer, experts)
        keys = [UnitKey(layer, "expert", e) for e in experts]
        parts = {}
        for key, ew in self.source.acquire(keys):  # resident experts first, the rest as their reads land
            try:
                parts[key.expert] = expert_part(h, indices, weights, key.expert, ew, self.ops.expert)
            finally:
                self.source.release([key])  # frees the slot for the next expert's read
        out = combine(h, parts)
        shared = self.ops.shared_experts(layer, w, h)
        return out if shared is None else out + shared
