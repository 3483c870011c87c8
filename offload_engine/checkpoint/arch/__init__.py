"""Architecture registry, naming half: config.json `model_type` -> the module that parses its args and names its
tensors (mlx-lm's convention).

Each architecture is two halves. Here (checkpoint/arch/<family>.py): its ModelArgs dataclass, `args(spec)` (config.json
parsed and checked), `schema(args)` and, with MTP layers, `mtp_schema(args)` (the naming tables the checkpoint
reader and the planner use), exposed as the module's `NAMING`. In runtime/arch/: its ops (what the runtime computes
with those args), picked by runtime.arch.build_ops from the same model_type. A new family adds a module here, an
entry in _MODULES, and an ops class in runtime/arch/__init__.py's table (StandardOps where flags suffice).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from ...errors import CheckpointError

# model_type -> module under offload_engine.checkpoint.arch (a fixed table: nothing is imported by name from config)
_MODULES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",  # Kimi K2 ships DeepseekV3ForCausalLM under its own model_type
    "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",  # transformers' text-only Qwen3_5MoeForCausalLM saves this model_type
    "gpt_oss": "gpt_oss",
}


def architecture_modules() -> Mapping[str, str]:
    """The registry: model_type -> module name under offload_engine.checkpoint.arch (read-only)."""
    return MappingProxyType(_MODULES)


def supported_model_types() -> list[str]:
    return sorted(_MODULES)


def get_naming(model_type: str, config_path: Path | str = "config.json"):
    """The naming half of `model_type`'s architecture (`args`, `schema`, maybe `mtp_schema`; `name`)."""
    module = _MODULES.get(model_type)
    if module is None:
        raise CheckpointError(config_path, f"unsupported model_type {model_type!r}; supported: "
                                           f"{', '.join(supported_model_types())}")
    return importlib.import_module(f"{__name__}.{module}").NAMING
