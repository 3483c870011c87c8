"""Qwen2 / Qwen2.5 dense decoders: biased Q/K/V projections."""
from ..hf_config import ModelSpec
from .base import DecoderArgs, StandardNaming


def check_no_sliding_window(spec: ModelSpec) -> None:
    if spec.get("use_sliding_window"):
        raise spec.unsupported("use_sliding_window=true")


def _args(spec: ModelSpec) -> DecoderArgs:
    check_no_sliding_window(spec)
    return DecoderArgs(spec, qkv_bias=True)


NAMING = StandardNaming("qwen2", _args)
