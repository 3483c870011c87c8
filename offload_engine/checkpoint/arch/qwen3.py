"""Qwen3 dense decoders: per-head RMSNorm on Q and K before RoPE."""
from ..hf_config import ModelSpec
from .base import DecoderArgs, StandardNaming
from .qwen2 import check_no_sliding_window


def _args(spec: ModelSpec) -> DecoderArgs:
    check_no_sliding_window(spec)
    bias = bool(spec.get("attention_bias", False))
    return DecoderArgs(spec, qkv_bias=bias, o_bias=bias, qk_norm=True)


NAMING = StandardNaming("qwen3", _args)
