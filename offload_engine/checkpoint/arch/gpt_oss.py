"""gpt-oss (gpt-oss-20b, gpt-oss-120b), naming half: GptOssArgs parsed and checked from config.json, and the tensors.

Every layer is MoE: biased GQA attention with a learned per-head sink (`self_attn.sinks`), alternating sliding-window
and full attention (`layer_types`, `sliding_window`), a biased top-k router (`mlp.router`), and fused experts with
biases. The experts are stored two ways:
  bf16 (transformers' save)  `experts.gate_up_proj` [E, H, 2I] and `experts.down_proj` [E, I, H]: input-major, the
                             model multiplies x @ W; unit names `gate_up_t` / `down_t` say so
  MXFP4 (the releases)       `experts.gate_up_proj_blocks` [E, 2I, H/32, 16] + `_scales`, `down_proj_blocks`
                             [E, H, I/32, 16] + `_scales`: output-major [out, in] like every quantized weight here;
                             unit names `gate_up` / `down`, dequantized by runtime/linear.py
gate_up's 2I outputs interleave gate (even) and up (odd). The ops are runtime/arch/gpt_oss.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..hf_config import ModelSpec
from ..naming import ModelSchema, TensorSpec, UnitKey
from .base import DecoderArgs, StandardNaming, add_embed_and_head

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssArgs(DecoderArgs):
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    @property
    def experts_quantized(self) -> bool:
        """MXFP4 experts (the releases): declared output-major so checkpoint/formats.py finds their blocks."""
        return self.formats is not None and self.formats.config.method == "mxfp4"


def _layer_types(spec: ModelSpec) -> tuple[str, ...]:
    types = spec.get("layer_types")
    if types is None:  # transformers' default: sliding first, then alternating
        return tuple(SLIDING if (l + 1) % 2 else FULL for l in range(spec.num_layers))
    if not isinstance(types, list) or len(types) != spec.num_layers or not set(types) <= {SLIDING, FULL}:
        raise ConfigError(f"{spec.path}: layer_types must list {spec.num_layers} entries of {SLIDING!r} / {FULL!r}, "
                          f"found {types!r}")
    return tuple(types)


def _float(spec: ModelSpec, field: str, default: float) -> float:
    value = spec.get(field)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{spec.path}: {field} must be a positive number, found {value!r}")
    return float(value)


def _args(spec: ModelSpec) -> GptOssArgs:
    if spec.num_experts < 1 or spec.num_experts_per_tok < 1:
        raise ConfigError(f"{spec.path}: gpt_oss needs num_local_experts and num_experts_per_tok >= 1")
    if spec.num_heads % spec.num_kv_heads:
        raise ConfigError(f"{spec.path}: num_attention_heads={spec.num_heads} must be a multiple of "
                          f"num_key_value_heads={spec.num_kv_heads}")
    types = _layer_types(spec)
    window = spec.get("sliding_window")
    if SLIDING in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ConfigError(f"{spec.path}: sliding_window must be an integer >= 1 for sliding_attention layers, "
                          f"found {window!r}")
    bias = bool(spec.get("attention_bias", True))
    return GptOssArgs(spec, qkv_bias=bias, o_bias=bias, moe_layers=frozenset(range(spec.num_layers)),
                      moe_intermediate_size=spec.intermediate_size, norm_topk_prob=True, layer_types=types,
                      sliding_window=window if SLIDING in types else 0,
                      swiglu_alpha=_float(spec, "swiglu_alpha", 1.702), swiglu_limit=_float(spec, "swiglu_limit", 7.0))


class GptOssNaming(StandardNaming):
    def schema(self, a: GptOssArgs, fused_experts: bool = True) -> ModelSchema:
        """Experts are always fused in gpt-oss checkpoints, whatever `fused_experts` says."""
        s, schema = a.spec, ModelSchema()
        H, D, E, inter = s.hidden_size, s.head_dim, s.num_experts, s.intermediate_size
        add_embed_and_head(schema, s)
        q, kv = s.num_heads * D, s.num_kv_heads * D
        for l in range(s.num_layers):
            key, p = UnitKey(l, "dense"), f"model.layers.{l}."
            tensors = [("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,)),
                       ("self_attn.q_proj.weight", (q, H)), ("self_attn.k_proj.weight", (kv, H)),
                       ("self_attn.v_proj.weight", (kv, H)), ("self_attn.o_proj.weight", (H, q)),
                       ("self_attn.sinks", (s.num_heads,)), ("mlp.router.weight", (E, H)), ("mlp.router.bias", (E,))]
            if a.qkv_bias:
                tensors += [("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.bias", (kv,)),
                            ("self_attn.v_proj.bias", (kv,)), ("self_attn.o_proj.bias", (H,))]
            for local, shape in tensors:
                schema.add(key, local, TensorSpec(p + local, shape))
            x = f"{p}mlp.experts."
            for e in range(E):
                ek = UnitKey(l, "expert", e)
                if a.experts_quantized:
                    schema.add(ek, "gate_up", TensorSpec(x + "gate_up_proj", (2 * inter, H), index=e))
                    schema.add(ek, "down", TensorSpec(x + "down_proj", (H, inter), index=e))
                else:
                    schema.add(ek, "gate_up_t", TensorSpec(x + "gate_up_proj", (H, 2 * inter), index=e))
                    schema.add(ek, "down_t", TensorSpec(x + "down_proj", (inter, H), index=e))
                schema.add(ek, "gate_up_bias", TensorSpec(x + "gate_up_proj_bias", (2 * inter,), index=e))
                schema.add(ek, "down_bias", TensorSpec(x + "down_proj_bias", (H,), index=e))
        return schema


NAMING = GptOssNaming("gpt_oss", _args)
