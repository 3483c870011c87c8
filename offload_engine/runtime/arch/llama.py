"""Llama 2/3 (and Mistral-style) dense decoders."""
from ...checkpoint.hf_config import ModelSpec
from .base import DecoderArgs, StandardDecoder


def _args(spec: ModelSpec) -> DecoderArgs:
    if spec.get("mlp_bias"):
        raise spec.unsupported("mlp_bias=true")
    bias = bool(spec.get("attention_bias", False))
    return DecoderArgs(spec, qkv_bias=bias, o_bias=bias)


ARCH = StandardDecoder("llama", _args)
