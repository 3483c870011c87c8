"""The layer loop: embeddings, decoder layers, head, with weights asked for unit by unit."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..checkpoint.model import ModelCheckpoint
from ..checkpoint.naming import UnitKey
from ..checkpoint.stage import Stage
from ..constants import PREFILL_CHUNK
from ..errors import BudgetError, out_of_memory_as_error
from . import decode_plan
from .arch import build_ops
from .arch.base import LayerOps
from .kernels.decode import DecodeKernels
from .kv_cache import KVCache
from .layers import causal_mask
from .host_compute import HostCompute
from .moe import routed_experts
from .moe_block import MoEBlock
from .weights import WeightSource, hold, lookup


class CausalLM:
    """forward(tokens, cache) -> float32 logits; the architecture computes, the source supplies weights."""

    def __init__(self, checkpoint: ModelCheckpoint, source: WeightSource, device: torch.device, dtype: torch.dtype,
                 max_context: int | None = None, prefill_chunk: int = PREFILL_CHUNK, *, ops: LayerOps | None = None,
                 prefetcher: Any = None, host_compute: HostCompute | None = None,
                 routing_trace: list[tuple[int, list[list[int]]]] | None = None, kv_dtype: str = "auto",
                 stage: Stage | None = None, kernels: DecodeKernels | None = None):
        """ops: the architecture's layer ops for this device and dtype (built from the checkpoint when None);
        prefetcher: a prefetch.Prefetcher reading the next layers' units while one computes, where weights stream
        (not imported here: prefetch/ builds on the store, which builds on runtime/weights.py); host_compute:
        which experts the CPU computes where they lie in RAM; routing_trace: a list every MoE layer's routing is
        appended to, as (layer, [experts per token]) (tools/trace_experts.py); kv_dtype: how its caches store
        attention entries (modes.KV_DTYPES, kv_storage.py); stage: the decoder layers this model runs, one rank's
        part of a pipeline (distributed/pipeline.py drives `embed`, `run_layers` and `head` across ranks); None:
        all of them. kernels: the native CPU kernels a bf16 decode takes (runtime/kernels/decode.py), bound to the
        ops (`with_kernels`), which pass them on to every product they make; None: torch's ops only."""
        self.checkpoint = checkpoint
        self.spec = checkpoint.spec
        self.source = source
        self.device, self.dtype = device, dtype
        if ops is None:
            ops = build_ops(checkpoint.arch.name, checkpoint.args, device, dtype, kernels=kernels)
        elif kernels is not None and getattr(ops, "kernels", None) is not kernels:
            ops = ops.with_kernels(kernels)
        self.ops = ops
        self.vocab_size = self.spec.vocab_size
        self.num_layers = self.spec.num_layers
        self.stage = stage
        self.layers = stage.layers if stage is not None else range(self.num_layers)
        self.max_context = max_context  # the KV cache reserved in the budget holds this many positions
        self.prefill_chunk = prefill_chunk  # a longer causal run goes through this many tokens per forward_once
        self.prefetcher = prefetcher
        self.routing_trace = routing_trace
        self.kv_dtype = kv_dtype
        self.kernels: DecodeKernels | None = getattr(ops, "kernels", None)
        # the MoE layers' feed-forward, its compute path fixed here (moe_block.py): the trunk's, which shows its
        # routing to the prefetcher and the trace and may hand experts to the host; the MTP layers' (mtp.py),
        # computed on the compute device and seen by neither
        self.moe = MoEBlock(ops, source, self.kernels, device, dtype, prefetcher=prefetcher,
                            host_compute=host_compute, routing_trace=routing_trace)
        self.mtp_moe = MoEBlock(ops, source, self.kernels, device, dtype)
        self._views: dict[str, CausalLM] = {}
        self._view_wraps: dict[str, Callable[[LayerOps], LayerOps]] = {}  # name -> the wrap its view was built with
        # layer -> the residual stream after its attention and after the whole layer, at the last token of the
        # latest forward (_route_ahead)
        self._previous: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # a decode step through all layers in one native call where the weights never move (decode_plan.py):
        # built on the first one-row step; None where the model does not fit
        self.decode_plan: decode_plan.DecodePlan | None = None
        self._plan_built = False

    @property
    def host_compute(self) -> HostCompute | None:
        """Which experts the host computes: the trunk's MoE block holds it (set here, it is the block's)."""
        return self.moe.host_compute

    @host_compute.setter
    def host_compute(self, value: HostCompute | None) -> None:
        self.moe.host_compute = value

    def snapshot(self) -> dict:
        """The model's own counters, for stats: time the compute thread spent on host-computed experts."""
        return {"host_compute_s": self.moe.host_compute_s}

    def view(self, name: str, wrap: Callable[[LayerOps], LayerOps]) -> "CausalLM":
        """This model's checkpoint, weights and layers computed by `wrap(ops)` (a wrapper of this model's ops
        without the native kernels), with no prefetcher, host compute or routing trace: built on the first call
        for `name` and kept (the self drafter's restricted routing: speculative/drafters/self_draft.py); a later
        call for `name` must pass the same `wrap`. A view forwards into caches it is given; it shares the weight
        source, so it runs between the model's forwards, never during one. Its ops (one RestrictedRouting for the
        self drafter) are shared by every request's drafter: safe because the engine runs one request at a time
        (Engine._request), and each drafter sets its own settings on them before each draft."""
        got = self._views.get(name)
        if got is None:
            plain = self.ops.with_kernels(None) if self.kernels is not None else self.ops
            got = CausalLM(self.checkpoint, self.source, self.device, self.dtype, self.max_context,
                           self.prefill_chunk, ops=wrap(plain), kv_dtype=self.kv_dtype, stage=self.stage)
            self._views[name] = got
            self._view_wraps[name] = wrap
        elif self._view_wraps[name] is not wrap:
            raise ValueError(f"view {name!r} was built with {self._view_wraps[name]!r}, not {wrap!r}: one name, "
                             f"one wrapper")
        return got

    def new_cache(self, max_tokens: int) -> KVCache:
        if self.max_context is not None and max_tokens > self.max_context:
            raise BudgetError("kv-cache", max_tokens, self.max_context,
                              hint="prompt + max_new_tokens exceed the context reserved; pass a larger max_context")
        return KVCache(self.num_layers, max_tokens, self.device, kv_dtype=self.kv_dtype)

    def layer_loop_only(self) -> None:
        """Decode through the layer loop from now on, never all layers in one call (what tests and
        tools/decode_profile.py compare the decode plan with)."""
        self.decode_plan, self._plan_built = None, True

    def _unit(self, key: UnitKey):
        return hold(self.source, key)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, last_only: bool = False, return_hidden: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [T] follow the cache's committed content; mask [T, cache.length + T] for draft trees.

        return_hidden: also return the last decoder layer's output before the final norm [T, H] (what MTP
        heads consume). An allocator out-of-memory error (KV cache, activations, a weight copy) fails this
        call with a DeviceOOMError; the cache is not advanced, so the request can be retried or dropped.

        A causal run of more than `prefill_chunk` tokens (a long prompt) goes through in chunks of that many, each
        attending to the cache: its activations stay what the planner charged for (planner/plan.py
        activation_bytes) instead of growing with the prompt's square. Each chunk reads the experts it routes
        to, so a prompt of n chunks may read a cache-missing expert up to n times."""
        with out_of_memory_as_error(f"forward pass on {self.device}"):
            if mask is None and positions is None and tokens.shape[0] > self.prefill_chunk:
                return self._chunked(tokens, cache, last_only, return_hidden)
            return self.forward_once(tokens, cache, positions, mask, last_only, return_hidden)

    def _chunked(self, tokens: torch.Tensor, cache: KVCache, last_only: bool, return_hidden: bool
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """forward_once() one prefill_chunk at a time: the rows it would return, the cache advanced by all of them, or
        on a failure by none (the chunks that went through are trimmed off where the cache can rewind)."""
        start, outs = cache.length, []
        try:
            for at in range(0, tokens.shape[0], self.prefill_chunk):
                out = self.forward_once(tokens[at:at + self.prefill_chunk], cache, None, None, last_only,
                                        return_hidden)
                outs.append(out if return_hidden else (out, None))
        except BaseException as failure:
            try:
                cache.trim(cache.length - start)
            except ValueError as why:  # a recurrent layer's state past a chunked forward cannot be rewound
                failure.add_note(f"the cache keeps the {cache.length - start} positions before the failure: {why}")
            raise
        if last_only:  # every chunk's last row was computed; the last chunk's is the answer
            outs = outs[-1:]
        logits = torch.cat([rows for rows, _ in outs])
        return (logits, torch.cat([x for _, x in outs])) if return_hidden else logits

    def forward_once(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None,
                     mask: torch.Tensor | None, last_only: bool, return_hidden: bool
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One pass over all of `tokens`, never chunked: what forward() runs for a short input, and for each chunk
        of a long one (the seam where tests inject a fault into one chunk)."""
        tokens = tokens.to(self.device)
        T = tokens.shape[0]
        if positions is None:
            positions = torch.arange(cache.length, cache.length + T, device=self.device)
        if mask is None:
            mask = causal_mask(positions, cache.length + T)
        x = self.run_layers(self.embed(tokens), positions, cache, mask)
        if last_only:
            x = x[-1:]
        logits = self.head(x)
        if self.prefetcher is not None:
            self.prefetcher.forward_finished()
        cache.advance(T)
        return (logits, x) if return_hidden else logits

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> their embeddings [T, H] (the first stage's input)."""
        return lookup(self.source, UnitKey(-1, "embed"), tokens, self.ops.embed)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last decoder layer's output [T, H] -> float32 logits [T, V] (final norm and lm_head)."""
        with self._unit(UnitKey(self.num_layers, "head")) as w:
            return self.ops.logits(w, x)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor
                   ) -> torch.Tensor:
        """This model's decoder layers (`self.layers`) over the residual stream x [T, H]; the cache is advanced by
        the caller, once every layer of the forward has appended to it."""
        if self.kernels is not None and x.shape[0] == 1:
            if not self._plan_built:
                self._plan_built = True
                self.decode_plan = decode_plan.build(self)
            out = None if self.decode_plan is None else self.decode_plan.run(self, x, positions, cache, mask)
            if out is not None:
                return out
        ops = self.ops
        prefetcher = self.prefetcher
        for layer in self.layers:
            with self._unit(UnitKey(layer, "dense")) as w:
                # a decode step's attention block (and router) in one native call where every part takes the
                # native kernels; otherwise one op at a time (the same bits either way)
                block = ops.decode_block(layer, w, x, positions, cache, mask) if self.kernels is not None else None
                if block is None:
                    x = x + ops.attention(layer, w, ops.input_norm(layer, w, x), positions, cache, mask)
                    h = logits = None
                else:
                    x, h, logits = block
                after_attention = x
                if prefetcher is not None:  # reads for the next layers start while this one computes
                    prefetcher.after_attention(layer, x)
                if h is None:
                    h = ops.post_norm(layer, w, x)
                if ops.is_moe(layer):
                    x = self.moe(layer, w, h, self._route_ahead(layer, x), residual=x, logits=logits)
                else:
                    x = x + ops.dense_mlp(layer, w, h)
                if prefetcher is not None and prefetcher.config.route_ahead:  # what the next forward predicts from
                    self._previous[layer] = (after_attention[-1:].clone(), x[-1:].clone())  # not views of [T, H]
        return x

    def _route_ahead(self, layer: int, x: torch.Tensor) -> Callable[[torch.Tensor], None] | None:
        """What layer `layer` does while it waits for expert reads: predict the routing of the next MoE layers
        (PrefetchConfig.route_ahead of them) and read their experts, so that those reads start a layer early.
        Returns a function of the layer's output so far, or None when there is nothing to predict.

        Layer n's router input is guessed as this layer's output so far (x plus the partial output) moved by what
        the layers between did to the previous forward's last token: its residual stream at layer n's router
        minus its residual after this layer. Consecutive tokens' layer outputs differ little next to the
        residual stream: on the bench model, offline with one of this layer's eight experts missing, this names
        95% of the next layer's experts and 92% of the one after, where that layer's router applied to x alone
        (prefetch/predictor.py's lookahead) names 63%; in the engine at 25%, 77% of the reads it started were
        used. A prediction costs a router product, in time the compute thread would spend waiting (predicting
        after every layer's experts instead read more and hid less in A/B runs: docs/PERF.md)."""
        prefetcher, previous = self.prefetcher, self._previous
        ahead = prefetcher.routes_ahead(x.shape[0]) if prefetcher is not None else 0
        targets = [n for n in range(layer + 1, min(layer + 1 + ahead, self.layers.stop))
                   if self.ops.is_moe(n) and n in previous]
        if not targets or layer not in previous:
            return None
        ops, done = self.ops, previous[layer][1]

        def predict(partial: torch.Tensor) -> None:
            now = x + partial
            for n in targets:
                w = prefetcher.resident_weights(UnitKey(n, "dense"))
                if w is None:  # layer n's dense unit (its router) is not resident: no I/O to predict I/O
                    continue
                indices, weights = ops.route(n, w, ops.post_norm(n, w, now + (previous[n][0] - done)))
                prefetcher.routed_ahead(n, routed_experts(indices, weights))
        return predict
