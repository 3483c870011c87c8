"""Architecture registry: config.json `model_type` -> architecture module (mlx-lm's convention)."""
from __future__ import annotations

import importlib
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from ...errors import CheckpointError

# model_type -> module under offload_engine.runtime.arch (a fixed table: nothing is imported by name from config)
_MODULES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",  # Kimi K2 ships DeepseekV3ForCausalLM under its own model_type
    "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",  # transformers' text-only Qwen3_5MoeForCausalLM saves this model_type
}


def architecture_modules() -> Mapping[str, str]:
    """The registry: model_type -> module name under offload_engine.runtime.arch (read-only)."""
    return MappingProxyType(_MODULES)


def supported_model_types() -> list[str]:
    return sorted(_MODULES)


def get_architecture(model_type: str, config_path: Path | str = "config.json"):
    module = _MODULES.get(model_type)
    if module is None:
        raise CheckpointError(config_path, f"unsupported model_type {model_type!r}; supported: "
                                           f"{', '.join(supported_model_types())}")
    return importlib.import_module(f"{__name__}.{module}").ARCH
