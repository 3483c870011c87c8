"""Qwen3-Next (`qwen3next`) and Qwen3.5/3.6-MoE (`qwen35moe`) GGUF files, as llama.cpp's converter writes them
(conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase, Qwen3_5MoeTextModel): their metadata as the
hybrid architectures' config (checkpoint/arch/qwen3_next.py), their tensor names, and what the converter changed:

  every norm but the DeltaNet's gated one   stored as 1 + w (zero-centred)   fix-up: w' - 1 (exact, fixups.py)
  A_log                                     stored as ssm_a = -exp(A_log)    fix-up: log(-a) (within an ulp)
  conv1d [C, 1, K]                          stored squeezed [C, K]           fix-up: a view as [C, 1, K]
  dt_bias                                   named ssm_dt.bias                names only
  Qwen3-Next in_proj_qkvz                   split into attn_qkv (q | k | v,  read as stored: `split_qkvz` args,
                                            each over all heads) + attn_gate  the layout Qwen3.5 releases have
                                            (earlier converter: as is, ssm_in) (ssm_in: in_proj_qkvz as it is)
  Qwen3.5 value heads (Hv > Hk)             reordered from grouped by key     read as stored: `v_heads_tiled`
                                            head to tiled (qkv's v rows, z,  (value head i reads key head
                                            b, a, A, dt_bias, conv, out_proj) i % Hk): every tensor consistently
  MTP layers (mtp.*)                        blocks N.. with nextn.* names    names only (resolved at open,
                                                                             added by attach_mtp_units)

The value-head order and the split projections are left as stored, so matrices keep their bytes (block types
included) and the kernels read them as they are; only vectors are fixed, when a unit's tensors are built.
llama.cpp hard-codes renormalized top-k for both (norm_topk_prob); a release with norm_topk_prob false would
not convert faithfully.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from ...errors import CheckpointFormatError
from ..arch.qwen3_next import FULL, LINEAR, HybridArgs
from .fixups import ArchHooks, Fixup, log_of_negated, minus_one, squeeze_middle, unsqueeze_middle
from .names import LAYER, gguf_name
from .reader import GGUFFile

ARCHS = {"qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe_text"}  # general.architecture -> model_type
MODEL_TYPES = tuple(ARCHS.values())
_LINEAR = {"in_proj_qkvz": "ssm_in", "in_proj_qkv": "attn_qkv", "in_proj_z": "attn_gate", "in_proj_b": "ssm_beta",
           "in_proj_a": "ssm_alpha", "in_proj_ba": "ssm_ba", "conv1d": "ssm_conv1d", "norm": "ssm_norm",
           "out_proj": "ssm_out"}
_LEAF = {"linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a",
         "post_attention_layernorm.weight": "post_attention_norm.weight"}


def config(g: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """The hybrid fields of the config (cfg: the common ones config.py derived; its num_hidden_layers counts the
    MTP blocks llama.cpp appends, which are taken off here)."""
    arch = g.get("general.architecture")

    def need(key: str) -> Any:
        value = g.get(f"{arch}.{key}")
        if value is None:
            raise CheckpointFormatError(g.path, f"metadata key {arch}.{key} missing")
        return value

    blocks, mtp = cfg["num_hidden_layers"], int(g.get(f"{arch}.nextn_predict_layers") or 0)
    layers = blocks - mtp
    if not 0 <= mtp < blocks:
        raise CheckpointFormatError(g.path, f"{arch}.nextn_predict_layers={mtp} of {blocks} blocks")
    recurrent = g.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        every = int(need("full_attention_interval"))
        types = [FULL if (l + 1) % every == 0 else LINEAR for l in range(layers)]
    elif isinstance(recurrent, list) and len(recurrent) == blocks:
        types = [LINEAR if r else FULL for r in recurrent[:layers]]
    else:
        raise CheckpointFormatError(g.path, f"{arch}.attention.recurrent_layers is not {blocks} flags")
    v_heads, inner, head_dim = int(need("ssm.time_step_rank")), int(need("ssm.inner_size")), \
        int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if v_heads < 1 or inner % v_heads:
        raise CheckpointFormatError(g.path, f"{arch}.ssm.inner_size={inner} is not a multiple of "
                                            f"{arch}.ssm.time_step_rank={v_heads}")
    rope_dim = int(g.get(f"{arch}.rope.dimension_count") or head_dim)
    return {"num_hidden_layers": layers, "layer_types": types, "mtp_num_hidden_layers": mtp,
            "linear_num_key_heads": int(need("ssm.group_count")), "linear_num_value_heads": v_heads,
            "linear_key_head_dim": int(need("ssm.state_size")), "linear_value_head_dim": inner // v_heads,
            "linear_conv_kernel_dim": int(need("ssm.conv_kernel")), "partial_rotary_factor": rope_dim / head_dim,
            "num_experts": int(need("expert_count")), "num_experts_per_tok": int(need("expert_used_count")),
            "moe_intermediate_size": int(need("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(g.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [l for l in range(layers) if f"blk.{l}.ffn_gate_inp.weight" not in g.tensors]}


def hybrid_name(hf_name: str) -> tuple[str, int | None] | None:
    """names.py's map plus the DeltaNet's tensors and the hybrids' post-attention norm."""
    m = LAYER.match(hf_name)
    if m is not None:
        layer, rest = m.group(1), m.group(2)
        if rest in _LEAF:
            return f"blk.{layer}.{_LEAF[rest]}", None
        module, _, leaf = rest.rpartition(".")
        if module.startswith("linear_attn.") and module[12:] in _LINEAR:
            return f"blk.{layer}.{_LINEAR[module[12:]]}.{leaf}", None
    return gguf_name(hf_name)


_MTP = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}


def mtp_name(hf_name: str, layers: int) -> tuple[str, int | None] | None:
    """MTP schema names (checkpoint/arch/qwen3_next.py mtp_schema) -> the converter's: MTP layer i is block
    layers + i, its fc and norms block `layers`'s nextn.* tensors."""
    if hf_name in _MTP:
        return f"blk.{layers}.{_MTP[hf_name]}", None
    m = re.match(r"^mtp\.layers\.(\d+)\.(.+)$", hf_name)
    return hybrid_name(f"model.layers.{layers + int(m.group(1))}.{m.group(2)}") if m else None


_NORM = Fixup("zero-centred norm stored as 1 + w", minus_one)
_A = Fixup("A_log stored as -exp(A_log)", log_of_negated)
_CONV = Fixup("conv1d stored squeezed", unsqueeze_middle, squeeze_middle)


def fixup(name: str) -> Fixup | None:
    """By GGUF name: the converter adds 1 to every tensor named *norm.weight but the DeltaNet's (ssm_norm)."""
    if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        return _NORM
    if name.endswith(".ssm_a"):
        return _A
    if name.endswith(".ssm_conv1d.weight"):
        return _CONV
    return None


def _next_args(a: HybridArgs, g: GGUFFile) -> HybridArgs:
    """Split q|k|v and z unless the file is a legacy one with the source's in_proj_qkvz as `ssm_in` (llama.cpp
    still reads those, per key head, as the source has it)."""
    legacy = bool(a.linear_layers) and f"blk.{a.linear_layers[0]}.ssm_in.weight" in g.tensors
    return dataclasses.replace(a, split_qkvz=not legacy)


def _moe35_args(a: HybridArgs, g: GGUFFile) -> HybridArgs:
    d = a.deltanet  # the converter reorders only when the head counts differ
    return dataclasses.replace(a, deltanet=dataclasses.replace(d, v_heads_tiled=d.num_v_heads != d.num_k_heads))


HOOKS = {"qwen3_next": ArchHooks(hybrid_name, fixup, _next_args, mtp_name),
         "qwen3_5_moe": ArchHooks(hybrid_name, fixup, _moe35_args, mtp_name)}
