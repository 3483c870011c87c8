"""Architecture registry, ops half: the naming half's family name -> the class of its per-layer ops.

The naming half (args, tensors) is checkpoint/arch/; an opened checkpoint carries it (`ModelCheckpoint.arch`, whose
`name` keys this table) and its parsed args. StandardOps computes every family that differs only in flags.
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import CheckpointError
from .base import LayerOps, StandardOps
from .deepseek_v3 import DeepseekV3Ops
from .gpt_oss import GptOssOps
from .qwen3_next import HybridOps

OPS = {"llama": StandardOps, "qwen2": StandardOps, "qwen3": StandardOps, "mixtral": StandardOps,
       "qwen2_moe": StandardOps, "qwen3_moe": StandardOps, "deepseek_v3": DeepseekV3Ops,
       "qwen3_next": HybridOps, "qwen3_5_moe": HybridOps, "gpt_oss": GptOssOps}


def build_ops(name: str, args, device: torch.device, dtype: torch.dtype, kernels: Any = None) -> LayerOps:
    """The ops of the architecture whose naming half is called `name` (ModelCheckpoint.arch.name), for `args`;
    kernels: the native decode kernels they compute with (runtime/kernels/decode.py DecodeKernels; None: torch's)."""
    cls = OPS.get(name)
    if cls is None:
        raise CheckpointError("config.json", f"architecture {name!r} has no runtime ops; implemented: "
                                             f"{', '.join(sorted(OPS))}")
    ops = cls(args, device, dtype)
    return ops if kernels is None else ops.with_kernels(kernels)
