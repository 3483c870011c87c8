"""A one-token decode step through every layer in one native call, where the model's weights never move.

When every unit is pinned in the compute tier (the budget holds the whole model: nothing streams, so nothing is
prefetched or evicted), a decode step's layers are the same calls every token: `StandardOps.decode_block`
(attention block and router), the router's softmax / top-k and `MoEBlock.one_row` (the routed experts, their
sum and the residual). `DecodePlan` hands the native side (kernels/native/decode_plan.cpp) every layer's kernel
forms once, then runs those calls for all layers per step: the same kernels in the same order, so the same bits
as the layer loop (tests/test_decode_plan.py compares every step's logits with `torch.equal`), without the
~250 us of Python a layer that loop costs between them on a 2-core CPU (docs/PERF.md, session 24).

It applies where each layer would take those one-call paths anyway: bf16 on the CPU with the native kernels,
a standard attention block (StandardOps' own norm, attention and softmax top-k routing) on every layer, every
layer a MoE layer with no shared experts, every expert on the native expert kernels; and no prefetcher, host
compute or routing trace (none exists when nothing streams, except a trace asked for). A step that does not fit
(several rows, a draft tree's mask, a KV cache that is not plain bf16 or is full) takes the layer loop.

Each unit a step uses is counted as a hit, as acquiring it would count it; pinned units are not stamped for
recency, which only orders eviction, and pinned units are never evicted.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.arch.base import DecoderArgs
from ..checkpoint.naming import UnitKey
from .arch.base import StandardOps
from .kernels.int_experts import IntExpert
from .kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass
class DecodePlan:
    native: Any  # the native DecodePlan (kernels/native/ops.h)
    layers: list[int]
    uses_per_step: int  # units a step uses: every layer's dense unit and its top-k experts

    def run(self, model, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None
            ) -> torch.Tensor | None:
        """The layers' output for one token x [1, H], its cache entries written at position cache.length; None,
        computing nothing, where this step does not fit (the caller runs the layer loop)."""
        ops: StandardOps = model.ops
        if ops.one_row_buffers(model.kernels, self.layers[0], x, positions, cache, mask) is None:
            return None
        buffers = [cache.plain_buffers(layer, x.dtype) for layer in self.layers]
        if any(b is None for b in buffers):
            return None
        cos, sin = ops.rotary.cos_sin(positions, x.dtype)
        out, _ = self.native.run(x.contiguous(), [b[0] for b in buffers], [b[1] for b in buffers], cos, sin,
                                 cache.length)
        model.source.count_uses(self.uses_per_step)
        return out


def build(model) -> DecodePlan | None:
    """The plan for `model` (a runtime.model.CausalLM), or None where a step's layers do not all take the
    one-call paths (the module's docstring lists when)."""
    why = _unfit(model)
    if why is not None:
        log.debug("decode plan off: %s", why)
        return None
    ops: StandardOps = model.ops
    kernels, s = model.kernels, ops.s
    native = kernels.module.DecodePlan(s.rms_norm_eps, s.head_dim ** -0.5, s.num_experts_per_tok,
                                       bool(ops.a.norm_topk_prob))
    experts_of: dict[int, list[int]] = {}
    for key in model.checkpoint.layouts:
        if key.kind == "expert":
            experts_of.setdefault(key.layer, []).append(key.expert)
    for layer in model.layers:
        forms = _layer_forms(model, layer, sorted(experts_of.get(layer, [])))
        if forms is None:
            log.debug("decode plan off: layer %d does not take the one-call paths", layer)
            return None
        native.add_layer(*forms)
    return DecodePlan(native, list(model.layers), len(model.layers) * (1 + s.num_experts_per_tok))


def arch_fits(ops_class: type, args: DecoderArgs) -> bool:
    """What the architecture fixes: a standard attention block with softmax top-k routing (StandardOps' own), no
    shared experts, every layer a MoE layer (planner/costs.py ONE_CALL_ARCHS names the classes that keep it)."""
    return issubclass(ops_class, StandardOps) and ops_class.keeps_standard_block() and args.routed_only()


def _unfit(model) -> str | None:
    """Why the model's steps cannot take a plan, from what is fixed at open; None where they may."""
    ops, kernels, source = model.ops, model.kernels, model.source
    placement = getattr(source, "placement", None)
    if kernels is None or not kernels.experts:
        return "no native expert kernels"
    if model.device.type != "cpu" or model.dtype is not torch.bfloat16:
        return "not a bf16 CPU model"
    if not arch_fits(type(ops), ops.a):
        return "not a standard attention block with softmax top-k routing, no shared experts, MoE on every layer"
    if placement is None or not hasattr(source, "count_uses") or not {"dense", "expert"} <= set(
            placement.compute.pinned):
        return "the layers' units are not all pinned in the compute tier"
    if model.prefetcher is not None or model.host_compute is not None or model.routing_trace is not None:
        return "a prefetcher, host compute or routing trace follows the layer loop"
    return None


def _layer_forms(model, layer: int, experts: list[int]) -> tuple | None:
    """DecodePlan.add_layer's arguments for `layer`: decode_block's forms and every expert's (plain or int,
    all alike, indexed by expert), or None where one takes another path."""
    ops: StandardOps = model.ops
    if experts != list(range(len(experts))):
        return None
    source = model.source
    dense = source.peek(UnitKey(layer, "dense"))  # views of pinned units: never moved, nothing to hold or count
    units = [source.peek(UnitKey(layer, "expert", e)) for e in experts]
    if dense is None or any(u is None for u in units):  # pinned units land at open; not there: no plan
        return None
    block = ops.block_forms(model.kernels, layer, dense)
    mats = [ops.gated_silu(u) for u in units]
    if block is None or not block[6] or any(m is None for m in mats):
        return None
    quantized = isinstance(mats[0], IntExpert)
    if any(isinstance(m, IntExpert) != quantized for m in mats):
        return None
    if quantized:
        gates, ups, downs = ([getattr(m, part) for m in mats] for part in ("gate", "up", "down"))
    else:
        gates, ups, downs = ([[m[part]] for m in mats] for part in range(3))
    return (*block, gates, ups, downs)
