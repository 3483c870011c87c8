"""A MoE layer's feed-forward on its own: route, compute the routed experts (resident ones first, the rest as
their reads land) and the shared experts, and add them to the residual stream.

`MoEBlock` is built once per model (CausalLM's constructor: one for the trunk's layers, one for its MTP layers)
with its compute path fixed there:
  native  the engine's grouped expert kernels (bf16 on the CPU, where decode.py chose them at open): the resident
          experts of a step in one call (`after_resident`), each later one as its read lands
  torch   each routed expert by the architecture's own ops (moe.expert_part), on the compute device, or where
          the host tier holds it when the host computes it (runtime/host_compute.py)
Two choices depend on the step, and each is one method: `one_row` (a one-token step whose routed experts are all
resident: residual, experts and shared experts in one native call) and `host_for` (whether the host computes
any of this forward's experts: by how many tokens each one got). Kernels come in the constructor (no context
variable); the weights come from the source, unit by unit.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Iterable

import torch

from ..checkpoint.naming import UnitKey
from .host_compute import HostCompute, HostInputs
from .kernels.decode import MAX_ROWS, DecodeKernels
from .kernels.int_experts import IntExpert
from .moe import SMALL_ROWS, RowRouting, combine, expert_part, native_parts, routed_experts
from .weights import Weights, WeightSource


class MoEBlock:
    """block(layer, w, h, ...) -> the layer's feed-forward output (plus `residual` where given)."""

    def __init__(self, ops: Any, source: WeightSource, kernels: DecodeKernels | None, device: torch.device,
                 dtype: torch.dtype, *, prefetcher: Any = None, host_compute: HostCompute | None = None,
                 routing_trace: list[tuple[int, list[list[int]]]] | None = None):
        """ops: the model's layer ops (route, shared_experts, expert, gated_silu); prefetcher: shown each
        layer's routing (the trunk's; None for MTP layers, whose routing it does not predict); host_compute:
        which experts the CPU computes where they lie in RAM (None: all on the compute device); routing_trace:
        the list each layer's routing is appended to (tools/trace_experts.py)."""
        self.ops, self.source = ops, source
        self.prefetcher, self.host_compute, self.routing_trace = prefetcher, host_compute, routing_trace
        # the grouped native kernels take a few bf16 rows on the CPU (MAX_ROWS: more take the torch path)
        self.native = (kernels if kernels is not None and kernels.experts and dtype == torch.bfloat16
                       and device.type == "cpu" else None)
        self.host_compute_s = 0.0  # time the compute thread spent on host-computed experts (their inputs' copies)

    def __call__(self, layer: int, w: Weights, h: torch.Tensor, ahead: Callable[[torch.Tensor], None] | None = None,
                 *, residual: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, H]: the layer's post-norm input; ahead: given this layer's output so far, starts the next
        layers' reads (CausalLM._route_ahead), called when the layer would otherwise wait for expert reads;
        residual: returned plus the layer's output (a one-token bf16 step adds them in one native call,
        combine_add: the same bits as the torch additions); logits: the router's product of h, where
        decode_block made it."""
        indices, weights = self.ops.route(layer, w, h) if logits is None else self.ops.route(layer, w, h, logits)
        routing = RowRouting(indices, weights) if 1 < h.shape[0] <= SMALL_ROWS else None
        experts = routed_experts(indices, weights) if routing is None else routing.order
        if self.routing_trace is not None:
            self.routing_trace.append((layer, indices.tolist()))
        if self.prefetcher is not None:
            self.prefetcher.routed(layer, experts)
        keys = [UnitKey(layer, "expert", e) for e in experts]
        native = self.native if h.shape[0] <= MAX_ROWS else None
        host, tokens = self.host_for(indices)
        step = _Step(self, layer, w, h, indices, weights, routing, native, ahead)
        # all of them resident (a decode step where the budget holds them): handed over at once, no generator
        ready = self.source.acquire_ready(keys) if native is not None and hasattr(self.source, "acquire_ready") \
            else None
        if ready is not None and residual is not None and host is None and h.shape[0] == 1:
            out = self.one_row(native, h, indices, weights, keys, ready, residual, step.shared)
            if out is not None:
                return out
        grouped = {} if native is None else {"after_resident": step.after_resident}
        on_host = None if host is None else (lambda key: host.wants(tokens[key.expert]))
        units = (zip(keys, ready) if ready is not None
                 else self.source.acquire(keys, None if ahead is None else step.wait_work, on_host=on_host,
                                          **grouped))
        # the routing's inputs for experts computed on the host: their copy is queued now, before the resident
        # experts' kernels (`acquire` starts when iterated), so the CPU need not wait for those to finish
        staged = HostInputs.stage(h, indices, weights) if host is not None and h.device.type == "cuda" else None
        step.compute(units, keys, ready, staged, host, tokens)
        if residual is None:
            return step.output()
        if native is not None and h.shape[0] == 1:
            extra = step.shared()
            return native.module.combine_add(residual, [step.parts[e][1] for e in sorted(step.parts)],
                                             None if extra is None else extra.contiguous())
        return residual + step.output()

    def host_for(self, indices: torch.Tensor) -> tuple[HostCompute | None, Counter | None]:
        """The host compute this forward asks, and the tokens routed to each expert; (None, None) where no expert
        of it would be computed there (auto rules the host out: nothing to stage, nothing to ask)."""
        host = self.host_compute
        if host is None:
            return None, None
        tokens = Counter(indices.flatten().tolist())
        if not any(host.wants(n) for n in set(tokens.values())):
            return None, None
        return host, tokens

    def one_row(self, native: DecodeKernels, h: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                keys: list[UnitKey], ready: list[Weights], residual: torch.Tensor,
                shared: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """A one-token step whose routed experts are all resident (acquired: `ready`) and take one native kernel:
        residual + their parts + the shared experts in one call (moe_row: native_parts' and combine_add's bits),
        the experts released after it. None, computing and releasing nothing, where one takes another path (the
        caller then goes one by one). Compute-tier units lie on h's device: no host hand-over here."""
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


class _Step:
    """One call's state: the experts' parts as they are computed, the native kernel's pending group, the shared
    experts (computed once, when first needed)."""

    def __init__(self, block: MoEBlock, layer: int, w: Weights, h: torch.Tensor, indices: torch.Tensor,
                 weights: torch.Tensor, routing: RowRouting | None, native: DecodeKernels | None,
                 ahead: Callable[[torch.Tensor], None] | None):
        self.block, self.layer, self.w, self.h = block, layer, w, h
        self.indices, self.weights, self.routing, self.native, self.ahead = indices, weights, routing, native, ahead
        self.parts: dict = {}
        self.pending: list[tuple[UnitKey, Any]] = []  # held for the native kernel, computed by flush()
        self.grouping = native is not None  # the resident experts wait for after_resident, then one call
        self._shared: list[torch.Tensor | None] = []

    def shared(self) -> torch.Tensor | None:
        if not self._shared:
            self._shared.append(self.block.ops.shared_experts(self.layer, self.w, self.h))
        return self._shared[0]

    def output(self) -> torch.Tensor:
        out, extra = combine(self.h, self.parts), self.shared()
        return out if extra is None else out + extra

    def flush(self) -> None:
        """The pending experts by the native kernel, released after."""
        if not self.pending:
            return
        try:
            self.parts.update(native_parts(self.native, self.h, self.indices, self.weights,
                                           [(k.expert, m) for k, m in self.pending], self.routing))
        finally:
            self.block.source.release([k for k, _ in self.pending])
            self.pending.clear()

    def after_resident(self) -> None:
        """The source has handed over every resident expert: those go in one call, later ones one by one."""
        self.grouping = False
        self.flush()

    def wait_work(self) -> None:
        """What the layer does while it waits for a read: its output so far shown to `ahead`."""
        self.flush()
        self.ahead(self.output())

    def compute(self, units: Iterable[tuple[UnitKey, Weights]], keys: list[UnitKey], ready: list | None,
                staged: HostInputs | None, host: HostCompute | None, tokens: Counter | None) -> None:
        """Every routed expert's part, each unit released once computed (or on a failure)."""
        ops, source, h = self.block.ops, self.block.source, self.h
        elsewhere: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # the routing's inputs, moved once
        handed = 0
        try:
            for key, ew in units:
                handed += 1
                mats = ops.gated_silu(ew) if self.native is not None else None
                if mats is not None and (mats.down[0] if isinstance(mats, IntExpert) else mats[0]).device == h.device:
                    self.pending.append((key, mats))
                    if not self.grouping:
                        self.flush()
                    continue
                self.expert(key, ew, elsewhere, staged, host, tokens)
            self.flush()
        finally:
            if self.pending:  # a failure: what was held and not computed is given back
                source.release([k for k, _ in self.pending])
            if ready is not None and handed < len(keys):  # and what was acquired and never reached
                source.release(keys[handed:])

    def expert(self, key: UnitKey, ew: Weights, elsewhere: dict, staged: HostInputs | None,
               host: HostCompute | None, tokens: Counter | None) -> None:
        """One routed expert's part by the torch path, on the compute device or where the host tier holds it;
        the unit is released whatever happens."""
        block, h = self.block, self.h
        try:
            where = next(iter(ew.values())).device
            if where == h.device:
                self.parts[key.expert] = expert_part(h, self.indices, self.weights, key.expert, ew,
                                                     block.ops.expert, self.routing)
            else:  # handed over from the host tier to be computed there
                start = time.perf_counter()
                if where not in elsewhere:
                    elsewhere[where] = (staged.wait() if staged is not None and where.type == "cpu"
                                        else (h.to(where), self.indices.to(where), self.weights.to(where)))
                tok, y = expert_part(*elsewhere[where], key.expert, ew, block.ops.expert, self.routing)
                self.parts[key.expert] = (tok if isinstance(tok, slice) else tok.to(h.device), y.to(h.device))
                took = time.perf_counter() - start
                block.host_compute_s += took
                host.observe(took, tokens[key.expert])
        finally:
            block.source.release([key])  # frees the slot for the next expert's read
