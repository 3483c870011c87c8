"""The layer loop: embeddings, decoder layers, head, with weights asked for unit by unit."""
from __future__ import annotations

import time
from collections import Counter
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
from .kernels.decode import MAX_ROWS, DecodeKernels, using
from .kernels.int_experts import IntExpert
from .kv_cache import KVCache
from .layers import causal_mask
from .host_compute import HostCompute, HostInputs
from .moe import SMALL_ROWS, RowRouting, combine, expert_part, native_parts, routed_experts
from .weights import Weights, WeightSource, hold, lookup


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
        all of them."""
        self.checkpoint = checkpoint
        self.spec = checkpoint.spec
        self.source = source
        self.device, self.dtype = device, dtype
        self.ops = ops if ops is not None else build_ops(checkpoint.arch.name, checkpoint.args, device, dtype)
        self.vocab_size = self.spec.vocab_size
        self.num_layers = self.spec.num_layers
        self.stage = stage
        self.layers = stage.layers if stage is not None else range(self.num_layers)
        self.max_context = max_context  # the KV cache reserved in the budget holds this many positions
        self.prefill_chunk = prefill_chunk  # a longer causal run goes through this many tokens per forward_once
        self.prefetcher = prefetcher
        self.host_compute = host_compute
        self.host_compute_s = 0.0  # time the compute thread spent on them (their inputs' copies included)
        self.routing_trace = routing_trace
        self.kv_dtype = kv_dtype
        self.kernels = kernels
        # layer -> the residual stream after its attention and after the whole layer, at the last token of the
        # latest forward (_route_ahead)
        self._previous: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # a decode step through all layers in one native call where the weights never move (decode_plan.py):
        # built on the first one-row step; None where the model does not fit
        self.decode_plan: decode_plan.DecodePlan | None = None
        self._plan_built = False

    def snapshot(self) -> dict:
        """The model's own counters, for stats: time the compute thread spent on host-computed experts."""
        return {"host_compute_s": self.host_compute_s}

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
        with self._unit(UnitKey(self.num_layers, "head")) as w, using(self.kernels):
            return self.ops.logits(w, x)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor
                   ) -> torch.Tensor:
        """This model's decoder layers (`self.layers`) over the residual stream x [T, H]; the cache is advanced by
        the caller, once every layer of the forward has appended to it."""
        with using(self.kernels):
            return self._layers(x, positions, cache, mask)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor
                ) -> torch.Tensor:
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

    def moe(self, layer: int, w: Weights, h: torch.Tensor, ahead: Callable[[torch.Tensor], None] | None = None,
            *, trunk: bool = True, residual: torch.Tensor | None = None, logits: torch.Tensor | None = None
            ) -> torch.Tensor:
        """A MoE feed-forward: route h, compute the routed experts (resident ones first, the rest as their reads
        land) and the shared experts. ahead: given this layer's output so far (the experts computed, the shared
        experts), starts the next layers' reads (see _route_ahead); called when the layer would otherwise wait for
        expert reads. trunk=False (an MTP layer, runtime/mtp.py): its routing is neither recorded nor shown to the
        prefetcher (which predicts the trunk's layers), and its experts are computed on the compute device.
        residual: returned plus the layer's output (for a one-token bf16 step one native call, combine_add: the same
        bits as the torch additions). logits: the router's product of h, where decode_block made it."""
        indices, weights = self.ops.route(layer, w, h) if logits is None else self.ops.route(layer, w, h, logits)
        routing = RowRouting(indices, weights) if 1 < h.shape[0] <= SMALL_ROWS else None
        experts = routed_experts(indices, weights) if routing is None else routing.order
        if trunk and self.routing_trace is not None:
            self.routing_trace.append((layer, indices.tolist()))
        if trunk and self.prefetcher is not None:
            self.prefetcher.routed(layer, experts)
        keys = [UnitKey(layer, "expert", e) for e in experts]
        parts = {}
        shared: list[torch.Tensor | None] = []  # computed once, when first needed

        def shared_output() -> torch.Tensor | None:
            if not shared:
                shared.append(self.ops.shared_experts(layer, w, h))
            return shared[0]

        def output() -> torch.Tensor:
            out, extra = combine(h, parts), shared_output()
            return out if extra is None else out + extra

        # resident experts first, the rest as their reads land; with the native grouped kernel the resident ones
        # are computed in one call (`after_resident`), each later one as it lands
        native = self.kernels if (self.kernels is not None and self.kernels.experts and h.dtype == torch.bfloat16
                                  and h.device.type == "cpu" and h.shape[0] <= MAX_ROWS) else None
        pending: list[tuple[UnitKey, tuple[torch.Tensor, ...]]] = []
        grouping = [native is not None]

        def flush() -> None:
            if not pending:
                return
            try:
                parts.update(native_parts(native, h, indices, weights, [(k.expert, m) for k, m in pending], routing))
            finally:
                self.source.release([k for k, _ in pending])
                pending.clear()

        def after_resident() -> None:
            grouping[0] = False
            flush()

        wait_work = None if ahead is None else lambda: (flush(), ahead(output()))
        host = self.host_compute if trunk else None
        if host is not None:
            tokens = Counter(indices.flatten().tolist())  # tokens routed to each expert
            if not any(host.wants(n) for n in set(tokens.values())):
                host = None  # auto rules the host out for this forward: nothing to stage, nothing to ask
        on_host = None if host is None else (lambda key: host.wants(tokens[key.expert]))
        grouped = {} if native is None else {"after_resident": after_resident}
        # all of them resident (a decode step where the budget holds them): handed over at once, no generator
        ready = self.source.acquire_ready(keys) if native is not None and hasattr(self.source, "acquire_ready") \
            else None
        if ready is not None and residual is not None and host is None and h.shape[0] == 1:
            out = self.moe_row(native, h, indices, weights, keys, ready, residual, shared_output)
            if out is not None:
                return out
        units = (zip(keys, ready) if ready is not None
                 else self.source.acquire(keys, wait_work, on_host=on_host, **grouped))
        # the routing's inputs for experts computed on the host: their copy is queued now, before the resident
        # experts' kernels (`acquire` starts when iterated), so the CPU need not wait for those to finish
        staged = HostInputs.stage(h, indices, weights) if host is not None and h.device.type == "cuda" else None
        elsewhere: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # the routing's inputs, moved once
        handed = 0
        try:
            for key, ew in units:
                handed += 1
                mats = self.ops.gated_silu(ew) if native is not None else None
                if mats is not None and (mats.down[0] if isinstance(mats, IntExpert) else mats[0]).device == h.device:
                    pending.append((key, mats))
                    if not grouping[0]:
                        flush()
                    continue
                self._expert(key, ew, h, indices, weights, parts, elsewhere, staged, host, tokens if host else None,
                             routing)
            flush()
        finally:
            if pending:  # a failure: what was held and not computed is given back
                self.source.release([k for k, _ in pending])
            if ready is not None and handed < len(keys):  # and what was acquired and never reached
                self.source.release(keys[handed:])
        if residual is None:
            return output()
        if native is not None and h.shape[0] == 1:
            extra = shared_output()
            return native.module.combine_add(residual, [parts[e][1] for e in sorted(parts)],
                                             None if extra is None else extra.contiguous())
        return residual + output()

    def moe_row(self, native: DecodeKernels, h: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 keys: list[UnitKey], ready: list[Weights], residual: torch.Tensor,
                 shared: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """moe() of a one-token step whose routed experts are all resident (acquired: `ready`) and take one native
        kernel: residual + their parts + the shared experts in one call (moe_row: native_parts' and combine_add's
        bits), the experts released after it. None, computing and releasing nothing, where one takes another
        path (the caller then goes one by one). Compute-tier units lie on h's device: no host hand-over here."""
        mats = [self.ops.gated_silu(u) for u in ready]
        quantized = isinstance(mats[0], IntExpert)
        if any(m is None or isinstance(m, IntExpert) != quantized for m in mats):
            return None
        order = sorted(range(len(keys)), key=lambda i: keys[i].expert)  # the sum's ascending expert order
        routed = indices[0].tolist()
        try:
            if quantized:
                gates, ups, downs = ([getattr(mats[i], part) for i in order] for part in ("gate", "up", "down"))
            else:
                gates, ups, downs = ([[mats[i][part]] for i in order] for part in range(3))
            extra = shared()
            return native.module.moe_row(residual, h.contiguous(), weights[0].to(h.dtype),
                                         [routed.index(keys[i].expert) for i in order], gates, ups, downs,
                                         None if extra is None else extra.contiguous())
        finally:
            self.source.release(keys)

    def _expert(self, key: UnitKey, ew: Weights, h: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                parts: dict, elsewhere: dict, staged: HostInputs | None, host: HostCompute | None,
                tokens: Counter | None, routing: RowRouting | None = None) -> None:
        """One routed expert's part by the torch path, on the compute device or where the host tier holds it;
        the unit is released whatever happens."""
        try:
            where = next(iter(ew.values())).device
            if where == h.device:
                parts[key.expert] = expert_part(h, indices, weights, key.expert, ew, self.ops.expert, routing)
            else:  # handed over from the host tier to be computed there
                start = time.perf_counter()
                if where not in elsewhere:
                    elsewhere[where] = (staged.wait() if staged is not None and where.type == "cpu"
                                        else (h.to(where), indices.to(where), weights.to(where)))
                tok, y = expert_part(*elsewhere[where], key.expert, ew, self.ops.expert, routing)
                parts[key.expert] = (tok if isinstance(tok, slice) else tok.to(h.device), y.to(h.device))
                took = time.perf_counter() - start
                self.host_compute_s += took
                host.observe(took, tokens[key.expert])
        finally:
            self.source.release([key])  # frees the slot for the next expert's read

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
