"""Qwen2 / Qwen2.5 dense decoders: biased Q/K/V projections."""
from ...checkpoint.hf_config import ModelSpec
from ...errors import ConfigError
from .base import DecoderArgs, StandardDecoder


def check_no_sliding_window(spec: ModelSpec) -> None:
    if spec.get("use_sliding_window"):
        raise ConfigError(f"{spec.path}: use_sliding_window=true is not supported yet")


def _args(spec: ModelSpec) -> DecoderArgs:
    check_no_sliding_window(spec)
    return DecoderArgs(spec, qkv_bias=True)


ARCH = StandardDecoder("qwen2", _args)
