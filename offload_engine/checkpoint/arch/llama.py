"""Llama 2/3 (and Mistral-style) dense decoders."""
from ..hf_config import ModelSpec
from .base import DecoderArgs, StandardNaming


def _args(spec: ModelSpec) -> DecoderArgs:
    if spec.get("mlp_bias"):
        raise spec.unsupported("mlp_bias=true")
    bias = bool(spec.get("attention_bias", False))
    return DecoderArgs(spec, qkv_bias=bias, o_bias=bias)


NAMING = StandardNaming("llama", _args)
