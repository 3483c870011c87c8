"""config.json -> frozen ModelSpec: the fields every architecture shares, under both naming generations.

Real downloads use the classic hub names (`rope_theta`, `rope_scaling`, `num_experts`, `torch_dtype`);
transformers 5 writes `rope_parameters`, `num_local_experts`, `dtype`. Both are accepted here, once, so
architecture modules read one normalized view. Architecture-specific fields stay in `raw` and are parsed by
the architecture's own `ModelArgs.from_spec`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import CheckpointFormatError
from .index import TORCH_DTYPE_NAMES

MAX_LAYERS = 4096  # sanity cap (cf. llama.cpp #25821): real models have < 200


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched `scale` times (DeepSeek's softmax scale uses it too)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str  # default | linear | llama3 | yarn | dynamic
    theta: float
    params: Mapping[str, Any] = field(default_factory=dict)  # factor, original_max_position_embeddings, beta_*, mscale...
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str  # torch dtype name of the checkpoint's weights ("bfloat16", "float32", ...)
    hidden_act: str
    rope: RopeSpec
    num_experts: int = 0  # 0 for dense models
    num_experts_per_tok: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)
    path: Path | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def require_int(self, key: str) -> int:
        value = self.raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointFormatError(self.path, f"field '{key}' must be a positive integer for model_type "
                                                   f"{self.model_type}, found {value!r}")
        return value

    def unsupported(self, feature: str) -> CheckpointFormatError:
        return CheckpointFormatError(self.path, f"{feature} is not supported for model_type {self.model_type}")


class _Reader:
    """Typed access to config.json with errors naming the file and the field."""

    def __init__(self, cfg: Mapping[str, Any], path: Path | str):
        self.cfg, self.path = cfg, path

    def first(self, *names: str, default: Any = ...) -> Any:
        for n in names:
            if self.cfg.get(n) is not None:
                return self.cfg[n]
        if default is ...:
            raise CheckpointFormatError(self.path, f"missing field {' / '.join(repr(n) for n in names)}")
        return default

    def int(self, *names: str, default: Any = ..., minimum: int = 1, maximum: int | None = None) -> int:
        v = self.first(*names, default=default)
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum or (maximum is not None and v > maximum):
            bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            raise CheckpointFormatError(self.path, f"field '{names[0]}' must be an integer {bound}, found {v!r}")
        return v

    def float(self, *names: str, default: Any = ...) -> float:
        v = self.first(*names, default=default)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise CheckpointFormatError(self.path, f"field '{names[0]}' must be a number, found {v!r}")
        return float(v)


def _rope(r: _Reader, head_dim: int) -> RopeSpec:
    cfg = r.cfg
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    elif scaling is not None:
        raise CheckpointFormatError(r.path, f"field 'rope_scaling' must be an object or null, found {scaling!r}")
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers prefers a top-level original_max_position_embeddings (Phi-3 style), else the field, else max
        top = cfg.get("original_max_position_embeddings")
        if top is not None:
            params["original_max_position_embeddings"] = top
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return RopeSpec(rope_type=str(rope_type), theta=float(theta), params=params, partial_rotary_factor=float(partial))


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value if isinstance(v, int))


def parse_config(cfg: Mapping[str, Any], path: Path | str = "config.json") -> ModelSpec:
    text = cfg.get("text_config")
    if isinstance(text, Mapping) and "hidden_size" not in cfg:
        # vision-language releases (Qwen3.5/3.6): the language model's fields are nested; the top-level
        # model_type is kept because it tells the architecture where the language model's tensors live
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **text, "model_type": cfg.get("model_type")}
    r = _Reader(cfg, path)
    model_type = r.first("model_type")
    if not isinstance(model_type, str):
        raise CheckpointFormatError(path, f"field 'model_type' must be a string, found {model_type!r}")
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    head_dim = r.int("head_dim", default=hidden // heads)
    dtype = r.first("dtype", "torch_dtype", default="float32")
    if not isinstance(dtype, str) or dtype.replace("torch.", "") not in TORCH_DTYPE_NAMES:
        raise CheckpointFormatError(path, f"field 'torch_dtype' must name a floating dtype "
                                          f"({', '.join(sorted(TORCH_DTYPE_NAMES))}), found {dtype!r}")
    return ModelSpec(
        model_type=model_type,
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        num_layers=r.int("num_hidden_layers", maximum=MAX_LAYERS),
        num_heads=heads,
        num_kv_heads=r.int("num_key_value_heads", default=heads),
        head_dim=head_dim,
        intermediate_size=r.int("intermediate_size", default=4 * hidden),
        rms_norm_eps=r.float("rms_norm_eps", "layer_norm_epsilon", default=1e-6),
        max_position_embeddings=r.int("max_position_embeddings", default=4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype.replace("torch.", ""),
        hidden_act=str(r.first("hidden_act", "activation_function", default="silu")),
        rope=_rope(r, head_dim),
        num_experts=r.int("num_experts", "num_local_experts", "n_routed_experts", default=0, minimum=0),
        num_experts_per_tok=r.int("num_experts_per_tok", "num_experts_per_token", default=0, minimum=0),
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        raw=dict(cfg),
        path=Path(path) if not isinstance(path, Path) else path,
    )
