"""Qwen1.5/Qwen2-MoE: biased Q/K/V, routed experts plus a sigmoid-gated shared expert."""
from ..hf_config import ModelSpec
from .base import DecoderArgs, StandardNaming, sparse_layers
from .qwen2 import check_no_sliding_window


def moe_layers(spec: ModelSpec):
    return sparse_layers(spec, int(spec.get("decoder_sparse_step") or 1), tuple(spec.get("mlp_only_layers") or ()))


def _args(spec: ModelSpec) -> DecoderArgs:
    check_no_sliding_window(spec)
    return DecoderArgs(spec, qkv_bias=bool(spec.get("qkv_bias", True)), moe_layers=moe_layers(spec),
                       moe_intermediate_size=spec.require_int("moe_intermediate_size"),
                       norm_topk_prob=bool(spec.get("norm_topk_prob", False)),
                       shared_intermediate_size=int(spec.get("shared_expert_intermediate_size") or 0))


NAMING = StandardNaming("qwen2_moe", _args)
