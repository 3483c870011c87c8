"""Schemas from config fields alone, for what the runtime does not run yet: architectures the planner sizes
before the engine implements them, and the vision tower a text-only engine skips (counted, not placed)."""
from __future__ import annotations

from typing import Any, Mapping

from ..checkpoint.hf_config import ModelSpec
from ..checkpoint.naming import ModelSchema, TensorSpec, UnitKey

PLANNING_ONLY = ("gpt_oss",)


def _embed_head(schema: ModelSchema, s: ModelSpec, prefix: str) -> None:
    V, H = s.vocab_size, s.hidden_size
    schema.add(UnitKey(-1, "embed"), "weight", TensorSpec(f"{prefix}embed_tokens.weight", (V, H)))
    head = UnitKey(s.num_layers, "head")
    schema.add(head, "norm", TensorSpec(f"{prefix}norm.weight", (H,)))
    schema.add(head, "weight", TensorSpec("lm_head.weight" if not s.tie_word_embeddings
                                          else f"{prefix}embed_tokens.weight", (V, H)))


def vision_params(v: Mapping[str, Any]) -> int:
    """Qwen3.5's ViT: patch embed, position embedding, `depth` blocks, patch merger (text-only engine skips it)."""
    h, i, depth = v.get("hidden_size", 0), v.get("intermediate_size", 0), v.get("depth", 0)
    merge, out = v.get("spatial_merge_size", 2), v.get("out_hidden_size", 0)
    block = (3 * h * h + 3 * h) + (h * h + h) + (i * h + i) + (h * i + h) + 4 * h
    patch = v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * v.get("patch_size", 16) ** 2 * h + h
    m = h * merge * merge
    merger = 2 * h + (m * m + m) + (out * m + out)
    return depth * block + patch + v.get("num_position_embeddings", 0) * h + merger


def gpt_oss_schema(s: ModelSpec) -> ModelSchema:
    """gpt-oss: biased GQA attention with sinks, a biased router, fused experts [E, ...] with biases."""
    schema = ModelSchema()
    H, D, E, inter = s.hidden_size, s.head_dim, s.num_experts, s.intermediate_size
    _embed_head(schema, s, "model.")
    for l in range(s.num_layers):
        key, p = UnitKey(l, "dense"), f"model.layers.{l}."
        q, kv = s.num_heads * D, s.num_kv_heads * D
        for local, shp in (("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,)),
                           ("self_attn.q_proj.weight", (q, H)), ("self_attn.q_proj.bias", (q,)),
                           ("self_attn.k_proj.weight", (kv, H)), ("self_attn.k_proj.bias", (kv,)),
                           ("self_attn.v_proj.weight", (kv, H)), ("self_attn.v_proj.bias", (kv,)),
                           ("self_attn.o_proj.weight", (H, q)), ("self_attn.o_proj.bias", (H,)),
                           ("self_attn.sinks", (s.num_heads,)), ("mlp.router.weight", (E, H)),
                           ("mlp.router.bias", (E,))):
            schema.add(key, local, TensorSpec(p + local, shp))
        x = f"{p}mlp.experts."
        for e in range(E):
            ek = UnitKey(l, "expert", e)
            schema.add(ek, "gate_up", TensorSpec(x + "gate_up_proj", (H, 2 * inter), index=e))
            schema.add(ek, "gate_up_bias", TensorSpec(x + "gate_up_proj_bias", (2 * inter,), index=e))
            schema.add(ek, "down", TensorSpec(x + "down_proj", (inter, H), index=e))
            schema.add(ek, "down_bias", TensorSpec(x + "down_proj_bias", (H,), index=e))
    return schema
