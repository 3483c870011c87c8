"""From a checkpoint folder and an EngineConfig to the parts of an engine, each built once and given what it
needs in its constructor, in the order of the flow:

    checkpoint -> placement (planned before any weight is read; re-planned with the MTP layers for --spec
    mtp|auto) -> host-compute rates (measured before the store allocates) -> store -> prefetcher, host compute
    -> model -> tokenizer -> draft engine (assembled by this same function, with its own config)

The prefetcher and the host compute are built before the model and handed to its constructor: neither needs
the model, only the store, the layer ops (shared with the model and the KV sizing: one set of rotary tables)
and the checkpoint's spec. A failure or a Ctrl-C anywhere closes what was built (the store's reader threads
and descriptors, a draft engine's too).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpoint.layout import UnitLayout
from .checkpoint.model import ModelCheckpoint, open_model
from .checkpoint.naming import UnitKey
from .checkpoint.stage import Stage, restrict
from .config import MAX_DEPTH, MAX_WIDTH, Budget, EngineConfig, PrefetchConfig, SpeculativeConfig, size_bytes
from .constants import DEFAULT_CONTEXT
from .errors import ConfigError, PlanError
from .interrupts import finish_despite_interrupts
from .planner.costs import Machine
from .planner.kv import kv_bytes
from .planner.placement import Placement, ResolvedBudget
from .prefetch.predictor import Combined, FrequencyPrior, RouterLookahead
from .prefetch.prefetcher import Prefetcher
from .runtime.arch import build_ops
from .runtime.devices import resolve_device, resolve_dtype
from .runtime.host_compute import HostCompute, measure_machine
from .runtime.kernels.decode import DecodeKernels, expert_shape, plain_float_shapes
from .runtime.kernels.decode import choose as choose_decode_kernels
from .runtime.kernels.int_experts import int_expert_shape, int_linear_shapes
from .runtime.kernels.select import Kernels, slot_room
from .runtime.kv_cache import ROLLBACK
from .runtime.model import CausalLM
from .runtime.mtp import attach_mtp_units, mtp_layer_count, mtp_supported
from .speculative.drafters.draft_model import check_same_vocabulary
from .store.build import build_store, plan_for
from .store.store import TieredStore
from .tokenizer import Tokenizer

# KV entries a draft tree may occupy beyond the committed tokens during one verification pass; reserved (and
# charged) in every engine so any request may speculate
SPEC_ROOM = MAX_DEPTH * MAX_WIDTH + 1
PREDICTORS = ("combined", "lookahead", "prior")  # the prefetcher's expert predictor (make_prefetcher)


@dataclass
class EngineParts:
    """What an Engine runs on. `context`: prompt + generated tokens one request may hold; `draft`: the draft
    model's own parts (--spec draft|auto with a draft model)."""

    checkpoint: ModelCheckpoint
    store: TieredStore
    model: CausalLM
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    context: int
    speculative: SpeculativeConfig
    draft: "EngineParts | None" = None

    def close(self) -> None:
        """Idempotent (the store's and the draft's close are)."""
        close_parts(self.store, self.draft)


def close_parts(store: TieredStore | None, draft: Any) -> None:
    """Close a store and a draft (EngineParts or Engine), the draft even when the store's close raised."""
    try:
        if store is not None:
            store.close()
    finally:
        if draft is not None:
            draft.close()


def assemble(path: str | os.PathLike, config: EngineConfig, *, predictor: str = "combined",
             stage: Stage | None = None) -> EngineParts:
    """Open a Hugging Face folder within config.budget. Planning (and its BudgetError) happens before any weight
    is read. predictor: the prefetcher's expert predictor, "combined" (the engine's) or one of its parts alone
    ("lookahead", "prior"; tools/eval_demo.py scores each). stage: one pipeline rank's layers
    (checkpoint/stage.py): the store, placement and KV cache hold only its units, budget percentages are of their
    bytes, and only the last stage loads MTP layers and a draft model."""
    if predictor not in PREDICTORS:
        raise ConfigError(f"predictor must be one of {', '.join(PREDICTORS)}, got {predictor!r}")
    speculative, mode = config.speculative, config.speculative.mode
    device = resolve_device(config.device)
    checkpoint = open_model(path, allow_cast=config.allow_cast, stage=stage)
    dtype = resolve_dtype(config.dtype, device, checkpoint.spec.dtype)
    # percentages are of the checkpoint's tensor bytes (what the folder holds), whichever units --spec loads; a
    # stage's, of the bytes of the units it holds
    resolved = resolve_budget(config.budget, checkpoint.index.total_bytes if stage is None else
                              restrict(checkpoint, stage).total_bytes)
    context = config.max_context or min(checkpoint.spec.max_position_embeddings, DEFAULT_CONTEXT)
    ops = build_ops(checkpoint.arch.name, checkpoint.args, device, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()

    def room(layout: UnitLayout) -> int:
        return slot_room(layout, device, dtype) if config.kernels == "auto" else 0

    def plan(ck: ModelCheckpoint) -> tuple[Placement, bool]:
        ck = restrict(ck, stage)
        return plan_for(ck, resolved, device, _kv_bytes(ck, itemsize, context, config.kv_dtype, stage),
                        config.direct_io, room, cache_ram=config.cache_ram)

    placement, use_direct = plan(checkpoint)
    last = stage is None or stage.last
    # MTP layers read the embedding: a last stage whose folder lacks its shard runs without them
    has_embed = any(k.kind == "embed" for k in checkpoint.layouts)
    if mode == "mtp" and last and not has_embed:
        raise ConfigError("--spec mtp: this rank's folder lacks the embedding's shard, which MTP layers read")
    if mode in ("auto", "mtp") and last and has_embed:
        checkpoint, placement, use_direct = _with_mtp_units(checkpoint, placement, use_direct, plan,
                                                            required=mode == "mtp")
    checkpoint = restrict(checkpoint, stage)
    # the rates host_compute="auto" weighs, measured before the store allocates (the probes' buffers are
    # transient and outside the budget), and only where the host tier will cache experts apart from VRAM
    rates = (measure_machine(device, dtype)
             if config.host_compute == "auto" and device.type == "cuda" and placement.host_caches("expert") else None)
    store = build_store(checkpoint, placement, device, dtype, use_direct, config.policy, config.progress,
                        config.read_fn, stall_timeout=config.stall_timeout, copy_fn=config.copy_fn,
                        prefetch_slots=config.prefetch.slots,
                        prepare=Kernels() if config.kernels == "auto" else None,
                        keep_cache=resolved.host is None or config.direct_io == "off")  # off: the page cache allowed
    draft = None
    try:
        # the ops the model, its MoE blocks and the prefetcher's router lookahead compute with, bound to the native
        # decode kernels chosen for the checkpoint's shapes (its MTP layers' included)
        ops = ops.with_kernels(_decode_kernels(checkpoint, device, dtype, config))
        model = CausalLM(checkpoint, store, device, dtype, max_context=context + SPEC_ROOM,
                         prefill_chunk=config.prefill_chunk, ops=ops,
                         prefetcher=make_prefetcher(checkpoint, ops, store, config.prefetch, config.trace, predictor,
                                                    stage.layers if stage is not None else None),
                         host_compute=make_host_compute(config.host_compute, rates, store),
                         routing_trace=[] if config.record_routing else None, kv_dtype=config.kv_dtype,
                         stage=stage)
        if mode == "mtp" and last and not mtp_supported(model):
            raise ConfigError(f"--spec mtp: {checkpoint.root} has no multi-token-prediction layers the engine "
                              f"can run (config.json num_nextn_predict_layers, MTP tensors, architecture "
                              f"{checkpoint.arch.name})")
        tokenizer = Tokenizer.load_optional(checkpoint.root)
        if speculative.draft_model is not None and mode in ("auto", "draft") and last:
            draft = _assemble_draft(speculative, config.progress, device, dtype, context, config.kv_dtype)
            check_same_vocabulary(tokenizer, draft.tokenizer, model.vocab_size, draft.model.vocab_size)
        return EngineParts(checkpoint, store, model, tokenizer, device, dtype, context, speculative, draft)
    except BaseException:  # a Ctrl-C may land anywhere here
        finish_despite_interrupts(lambda: close_parts(store, draft))
        raise


def resolve_budget(budget: Budget, model_bytes: int) -> ResolvedBudget:
    """A Budget in bytes per tier: its sizes parsed, percentages of `model_bytes`."""
    return ResolvedBudget(device=size_bytes(budget.vram, "--vram", model_bytes),
                          host=size_bytes(budget.ram, "--ram", model_bytes))


def _assemble_draft(speculative: SpeculativeConfig, progress: bool, device: torch.device, dtype: torch.dtype,
                    context: int, kv_dtype: str) -> EngineParts:
    """The draft model as an engine of its own (store, budget, reader threads), on the target's device and dtype
    and KV storage, with room for the target's context, a draft tree and a chain beyond it."""
    config = EngineConfig(budget=speculative.draft_budget or Budget(), device=device, dtype=dtype,
                          max_context=context + SPEC_ROOM + MAX_DEPTH, prefetch=False, progress=progress,
                          kv_dtype=kv_dtype)
    return assemble(speculative.draft_model, config)


def make_prefetcher(checkpoint: ModelCheckpoint, ops: Any, store: TieredStore, config: PrefetchConfig,
                    trace: str | None, predictor: str = "combined", layers: range | None = None
                    ) -> Prefetcher | None:
    """Only when something streams: with every unit pinned there is nothing to read ahead. layers: the decoder
    layers the store holds (a pipeline stage's; None: all)."""
    if not config.enabled or not store.placement.streams:
        if trace:
            logging.getLogger("offload_engine").warning(
                "routing trace %s not used: %s", trace,
                "prefetching is off" if not config.enabled else "every unit is resident, nothing is read ahead")
        return None
    spec = checkpoint.spec
    layers = layers if layers is not None else range(spec.num_layers)
    moe_layers = [l for l in layers if ops.is_moe(l)]
    lookahead = RouterLookahead(ops, moe_layers, spec.num_experts_per_tok, config.margin,
                                lambda t: store.peek(UnitKey(t, "dense")))
    prior = FrequencyPrior(moe_layers, spec.num_experts_per_tok, Path(trace) if trace else None)
    chosen = {"combined": lambda: Combined(lookahead, prior), "lookahead": lambda: lookahead,
              "prior": lambda: prior}[predictor]()
    return Prefetcher(store, chosen, moe_layers, layers.stop, config, first_layer=layers.start)


def _decode_kernels(checkpoint: ModelCheckpoint, device: torch.device, dtype: torch.dtype, config: EngineConfig
                    ) -> DecodeKernels | None:
    """The native CPU kernels for a bf16 decode on the CPU, chosen per weight shape (runtime/kernels/decode.py);
    None on CUDA, in float32 (the parity tests' dtype) and with --kernels dequantize."""
    if device.type != "cpu" or dtype != torch.bfloat16 or config.kernels != "auto":
        return None
    layouts = checkpoint.layouts.values()
    spec = checkpoint.spec
    return choose_decode_kernels(plain_float_shapes(layouts),
                                 expert_shape(layouts, spec.num_experts_per_tok, spec.hidden_act),
                                 int_expert_shape(layouts, spec.num_experts_per_tok, spec.hidden_act),
                                 int_linear_shapes(layouts))


def make_host_compute(mode: str, rates: Machine | None, store: TieredStore) -> HostCompute | None:
    """Only where a host tier caches experts beyond its staging slots (a unit held for host compute must never
    leave a reader without one), and for "auto" only on a GPU."""
    if mode == "off" or not store.placement.host_caches("expert") or (mode == "auto" and not rates):
        return None
    layouts = [l for k, l in store.checkpoint.layouts.items() if k.kind == "expert"]
    biggest = max(layouts, key=lambda l: l.nbytes)
    params = sum(math.prod(t.shape) for t in biggest.slices)
    return HostCompute(mode, rates, biggest.nbytes, params)


# ---- placement with or without the MTP layers ------------------------------------------------------------------
def _kv_bytes(checkpoint: ModelCheckpoint, itemsize: int, context: int, kv_dtype: str,
              stage: Stage | None = None) -> int:
    """Every byte of per-sequence state one request may hold (the planner's formula, planner/kv.py): the main
    model's KV for the context plus a draft tree, its recurrent state with rollback logs, and each MTP layer's own
    cache (one attention layer's share, for the context, the tree and the MTP chain); attention entries as
    `kv_dtype` stores them. A stage: its layers'."""
    tokens = context + SPEC_ROOM
    return kv_bytes(checkpoint.spec, tokens, itemsize, rollback=ROLLBACK, mtp_layers=mtp_layer_count(checkpoint),
                    mtp_positions=tokens + MAX_DEPTH + 1, kv_dtype=kv_dtype,
                    layers=stage.layers if stage is not None else None)


# --spec auto loads MTP layers when they cost at most this share of the cache that streams units (measured on
# the demo model: giving up 15-50% of the expert cache for MTP lost 11-39% of decode speed at 25-40% budgets,
# and 9.7% of it (4 of 41 expert slots) lost 5-8% at 50% while the cost model never chose to draft with MTP;
# one MTP layer of a real model, e.g. DeepSeek-V3's 1 of 61, stays well under 5%)
MTP_CACHE_SHARE = 0.05


def _with_mtp_units(checkpoint: ModelCheckpoint, placement: Placement, use_direct: bool,
                    plan: Callable[[ModelCheckpoint], tuple[Placement, bool]], required: bool
                    ) -> tuple[ModelCheckpoint, Placement, bool]:
    """The checkpoint with its MTP layers as `mtp` units, and its placement. For "auto" only when they fit
    without un-pinning any of the model's own units and take at most MTP_CACHE_SHARE of the streaming caches: a
    dense layer or experts read from disk on every token cost more than MTP drafting saves, so auto then drafts
    without them (n-gram, self) rather than lose to plain decoding.
    "mtp" (required) loads them regardless, or fails with the budget's numbers."""
    with_mtp = attach_mtp_units(checkpoint)
    if with_mtp is checkpoint:
        return checkpoint, placement, use_direct
    try:
        mtp_placement, mtp_direct = plan(with_mtp)
    except PlanError:
        if required:
            raise
        return checkpoint, placement, use_direct
    if required or (_pinned(placement) <= _pinned(mtp_placement)
                    and _cache_bytes(mtp_placement) >= (1 - MTP_CACHE_SHARE) * _cache_bytes(placement)):
        return with_mtp, mtp_placement, mtp_direct
    return checkpoint, placement, use_direct


def _pinned(placement: Placement) -> set[tuple[str, str]]:
    return {(t.name, kind) for t in placement.tiers for kind in t.pinned}


def _cache_bytes(placement: Placement) -> int:
    """Bytes of cache slots for units that stream (kinds not pinned on that tier)."""
    return sum(n * placement.sizes[kind].slot_bytes for t in placement.tiers for kind, n in t.slots.items()
               if kind not in t.pinned)
