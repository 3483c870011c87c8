"""Multi-token prediction (MTP) layers shipped in a checkpoint, run through the model's weight source.

Two released formats, one computation. MTP layer k (checkpoint layer N + k, N = num_hidden_layers) at position p
combines the token at p with the previous depth's output at p - 1 (depth 0: the main model's final-normed hidden
state) and predicts the token at p + 1, sharing the main model's embedding and head:

    x   = proj([norm_e(embed(t_p)); norm_h(h_{p-1})])      (the embedding first)
    x   = block_k(x)                          (attention over layer k's own cache, MoE feed-forward)
    o_p = norm_o(x)                           (handed to depth k + 1)
    logits_p = head(o_p)                      (the main model's lm_head, no further norm)

  DeepSeek-V3 / Kimi K2 / GLM-4.5 (arch/deepseek_v3.py): `num_nextn_predict_layers` layers model.layers.{N + k}.*
  with norm_e / norm_h / proj / norm_o = enorm / hnorm / eh_proj / shared_head.norm and a full MoE decoder block.
  This is transformers' MtpModel / MtpLayer (modeling_layers.py: post_norm = shared_head.norm, embeddings first,
  the main model's `hidden_states[-1]`, i.e. after its final norm) and the DeepSeek-V3 report's eq. 21-23.

  Qwen3-Next / Qwen3.5-MoE (arch/qwen3_next.py): `mtp_num_hidden_layers` layers (Qwen3-Next's config does not
  say; its releases carry one) under top-level `mtp.*`: pre_fc_norm_embedding / pre_fc_norm_hidden / fc / norm
  (zero-centred norms) and mtp.layers.{k}.*, a full-attention layer named like a trunk layer (gated attention,
  MoE with a shared expert). transformers has no module for it; this follows vLLM's qwen3_next_mtp.py and
  qwen3_5_mtp.py (cat([embedding, hidden]) into fc; the MTP model returns mtp.norm's output, which compute_logits
  scores and the proposer feeds back as the next step's hidden state; the target's hidden state is its model
  output, after the final norm).

Rotary positions: an entry is placed at its token's position p (as transformers' MtpModel does); vLLM places it at
p - 1, the hidden state's. Every entry of a layer's cache moves by the same one, and RoPE scores depend only on
differences, so both give the same logits.

An architecture supports MTP with `mtp_schema` (the units, its tensors under the shared local names mtp.embed_norm,
mtp.hidden_norm, mtp.proj and mtp.out_norm) and the ops in MTP_OPS, which StandardOps implements once for both
formats with the architecture's own `norm`; this module runs the block with its ordinary per-layer ops
(input_norm, attention, post_norm, route, expert, shared_experts at layer N + k).

Units: one `mtp` unit per layer (everything but the routed experts) and `expert` units of layer N + k, added
to an opened checkpoint by `attach_mtp_units` when the tensors are present (released configs name MTP layers
even where converters dropped the tensors).
"""
from __future__ import annotations

import dataclasses

import torch

from ..checkpoint.layout import build_layout
from ..checkpoint.model import ModelCheckpoint
from ..checkpoint.opened import PrebuiltUnits
from ..checkpoint.naming import UnitKey
from ..errors import CheckpointFormatError
from .kv_cache import KVCache
from .layers import causal_mask
from .weights import hold, lookup


def attach_mtp_units(checkpoint: ModelCheckpoint) -> ModelCheckpoint:
    """The checkpoint with its MTP units in schema and layouts when every MTP tensor is present; unchanged when
    the architecture has no MTP layers or none of their tensors is there; CheckpointFormatError naming the
    first missing or misshapen tensor when only some are."""
    if checkpoint.mtp is not None:  # resolved by the reader (a GGUF file's MTP blocks)
        return _attach_prebuilt(checkpoint, checkpoint.mtp)
    make = getattr(checkpoint.arch, "mtp_schema", None)
    if make is None:
        return checkpoint
    extra = make(checkpoint.args, fused_experts=checkpoint.fused_experts)
    if not extra.units or all(k in checkpoint.schema.units for k in extra.units):
        return checkpoint
    tensors = checkpoint.index.tensors
    names = extra.hf_names()
    if not names & set(tensors):
        return checkpoint
    if not names <= set(tensors):  # MTP experts stored the other way (fused / per expert) than the trunk's
        other = make(checkpoint.args, fused_experts=not checkpoint.fused_experts)
        if other.hf_names() <= set(tensors):
            extra, names = other, other.hf_names()
    for key, specs in extra.units.items():
        for spec in specs.values():
            rec = tensors.get(spec.hf_name)
            if rec is None:
                raise CheckpointFormatError(
                    checkpoint.root, f"MTP tensor missing for unit {key} (config.json names MTP layers and other "
                                     f"MTP tensors are present)", tensor=spec.hf_name)
            shape = tuple(rec.shape) if spec.index is None else tuple(rec.shape[1:])
            if shape != tuple(spec.shape) or (spec.index is not None and spec.index >= rec.shape[0]):
                raise CheckpointFormatError(rec.file, f"shape {list(rec.shape)} disagrees with config.json: expected "
                                                      f"{list(spec.shape)}", tensor=rec.name)
    schema = dataclasses.replace(checkpoint.schema, units={**checkpoint.schema.units, **extra.units})
    layouts = {**checkpoint.layouts, **{k: build_layout(k, specs, tensors) for k, specs in extra.units.items()}}
    unused = sorted(set(checkpoint.unused_tensors) - names)
    return dataclasses.replace(checkpoint, schema=schema, layouts=layouts, unused_tensors=unused)


def _attach_prebuilt(checkpoint: ModelCheckpoint, mtp: PrebuiltUnits) -> ModelCheckpoint:
    if all(k in checkpoint.schema.units for k in mtp.schema.units):
        return checkpoint
    schema = dataclasses.replace(checkpoint.schema, units={**checkpoint.schema.units, **mtp.schema.units})
    return dataclasses.replace(checkpoint, schema=schema, layouts={**checkpoint.layouts, **mtp.layouts},
                               formats={**checkpoint.formats, **mtp.formats},
                               unused_tensors=sorted(set(checkpoint.unused_tensors) - mtp.tensors))


MTP_OPS = ("mtp_input", "mtp_output", "final_norm", "head_logits")  # what an architecture's ops must provide


def mtp_layer_count(checkpoint: ModelCheckpoint) -> int:
    """MTP layers available in this (opened, attached) checkpoint."""
    return sum(1 for k in checkpoint.schema.units if k.kind == "mtp")


def mtp_supported(model) -> bool:
    """The checkpoint ships MTP layers and its architecture implements their forward."""
    return mtp_layer_count(model.checkpoint) > 0 and all(hasattr(model.ops, op) for op in MTP_OPS)


class MtpHead:
    """The MTP layers of `model` (a CausalLM over a checkpoint with attached MTP units)."""

    def __init__(self, model):
        self.model = model
        self.ops = model.ops
        # the trunk's final norm before depth 0 by torch's op, as it has always run (outside the decode step's
        # native kernels, whose rms_norm rounds within a bf16 step of it): the drafts keep their bits
        self._norm_ops = model.ops.with_kernels(None) if model.kernels is not None else model.ops
        self.count = mtp_layer_count(model.checkpoint)
        if not self.count:
            raise CheckpointFormatError(model.checkpoint.root, "the checkpoint has no MTP layers (config.json "
                                                               "num_nextn_predict_layers / mtp_num_hidden_layers "
                                                               "= 0, or no MTP tensors)")
        for op in MTP_OPS:
            if not hasattr(self.ops, op):
                raise CheckpointFormatError(model.checkpoint.root, f"MTP layers are not implemented for "
                                                                   f"{model.checkpoint.arch.name}")
        self.base = model.num_layers  # MTP layer k is checkpoint layer base + k
        self.moe_layers = {k.layer for k in model.checkpoint.layouts if k.kind == "expert" and k.layer >= self.base}

    def new_cache(self, capacity: int) -> KVCache:
        """One layer's cache (MTP layers start at different positions, so each has its own)."""
        # only its own layer is allocated, stored as the model's caches are (the planner charges it so)
        return KVCache(self.base + self.count, capacity, self.model.device, kv_dtype=self.model.kv_dtype)

    def _unit(self, key: UnitKey):
        return hold(self.model.source, key)

    @torch.inference_mode()
    def trunk_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The main model's pre-norm output (CausalLM.forward(return_hidden=True)) -> what depth 0 consumes."""
        with self._unit(UnitKey(self.base, "head")) as head:
            return self._norm_ops.final_norm(head, hidden.to(self.model.dtype))

    @torch.inference_mode()
    def forward(self, k: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer k over T new entries appended to its own `cache` (whose entries are consecutive positions):
        tokens [T] at `positions` [T], hidden [T, H] the previous depth's outputs at positions - 1.
        Returns (float32 logits [T, V] for the tokens at positions + 1, outputs [T, H])."""
        model, ops, layer = self.model, self.ops, self.base + k
        device = model.device
        tokens, positions = tokens.to(device), positions.to(device)
        T = tokens.shape[0]
        mask = causal_mask(torch.arange(cache.length, cache.length + T, device=device), cache.length + T)
        embedded = lookup(model.source, UnitKey(-1, "embed"), tokens, ops.embed)
        with self._unit(UnitKey(layer, "mtp")) as w:
            x = ops.mtp_input(w, embedded, hidden.to(embedded.dtype))
            x = x + ops.attention(layer, w, ops.input_norm(layer, w, x), positions, cache, mask)
            h = ops.post_norm(layer, w, x)
            x = x + self._moe(layer, w, h)
            out = ops.mtp_output(w, x)
        cache.advance(T)
        with self._unit(UnitKey(self.base, "head")) as w:
            logits = ops.head_logits(w, out)
        return logits, out

    def _moe(self, layer: int, w, h: torch.Tensor) -> torch.Tensor:
        if layer not in self.moe_layers:
            return self.ops.dense_mlp(layer, w, h)
        return self.model.mtp_moe(layer, w, h)
