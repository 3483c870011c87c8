"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention (QK-norm), softmax top-k experts, no shared expert."""
from ..hf_config import ModelSpec
from .base import DecoderArgs, StandardNaming
from .qwen2 import check_no_sliding_window
from .qwen2_moe import moe_layers


def _args(spec: ModelSpec) -> DecoderArgs:
    check_no_sliding_window(spec)
    bias = bool(spec.get("attention_bias", False))
    return DecoderArgs(spec, qkv_bias=bias, o_bias=bias, qk_norm=True, moe_layers=moe_layers(spec),
                       moe_intermediate_size=spec.require_int("moe_intermediate_size"),
                       norm_topk_prob=bool(spec.get("norm_topk_prob", False)))


NAMING = StandardNaming("qwen3_moe", _args)
