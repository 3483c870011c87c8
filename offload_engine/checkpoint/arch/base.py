"""The naming half of an architecture: config.json -> ModelArgs (`args`), and its tensors as a ModelSchema
(`schema`: the naming table), for the standard pre-norm decoder most families share.

`StandardNaming` covers Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE: they differ only in flags (QKV bias,
QK-norm, which layers are MoE, where experts live in the checkpoint, shared experts). The ops half (what the runtime
computes with these args) is runtime/arch/.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..formats import WeightFormats
from ..hf_config import ModelSpec
from ..naming import ModelSchema, TensorSpec, UnitKey


@dataclass(frozen=True)
class DecoderArgs:
    spec: ModelSpec
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    moe_layers: frozenset[int] = frozenset()
    moe_prefix: str = "mlp"  # where the router and experts live: "mlp" or Mixtral's "block_sparse_moe"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_intermediate_size: int = 0  # Qwen2-MoE shared expert (with a sigmoid gate)
    formats: WeightFormats | None = None  # a quantized checkpoint's formats (set by open_model)

    def routed_only(self) -> bool:
        """Every layer's feed-forward is routed experts alone (no dense MLP layer, no shared experts): what a
        decode step through all layers in one native call takes (runtime/decode_plan.py)."""
        return not self.shared_intermediate_size and set(range(self.spec.num_layers)) <= self.moe_layers


def with_formats(a: DecoderArgs, schema: ModelSchema) -> ModelSchema:
    """`schema` with the checkpoint's quantized weights replaced by their stored components (MTP schemas, which
    open_model does not see)."""
    return schema if a.formats is None else a.formats.apply(schema)


def sparse_layers(spec: ModelSpec, step: int = 1, dense_only: tuple[int, ...] = ()) -> frozenset[int]:
    """Qwen-MoE rule: MoE where (l + 1) % decoder_sparse_step == 0 and l not in mlp_only_layers."""
    if spec.num_experts <= 0:
        return frozenset()
    return frozenset(l for l in range(spec.num_layers) if l not in dense_only and (l + 1) % max(step, 1) == 0)


def add_embed_and_head(schema: ModelSchema, spec: ModelSpec) -> None:
    V, H = spec.vocab_size, spec.hidden_size
    embed, head = UnitKey(-1, "embed"), UnitKey(spec.num_layers, "head")
    schema.add(embed, "weight", TensorSpec("model.embed_tokens.weight", (V, H)))
    schema.add(head, "norm", TensorSpec("model.norm.weight", (H,)))
    # Tied heads: the head unit holds the embedding matrix too (a second copy in memory, same bytes on disk)
    head_name = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    schema.add(head, "weight", TensorSpec(head_name, (V, H)))


def add_gated_mlp(schema: ModelSchema, key: UnitKey, hf_prefix: str, local_prefix: str, inter: int, hidden: int,
                  names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    g, u, d = names
    schema.add(key, f"{local_prefix}gate", TensorSpec(f"{hf_prefix}{g}.weight", (inter, hidden)))
    schema.add(key, f"{local_prefix}up", TensorSpec(f"{hf_prefix}{u}.weight", (inter, hidden)))
    schema.add(key, f"{local_prefix}down", TensorSpec(f"{hf_prefix}{d}.weight", (hidden, inter)))


def add_experts(schema: ModelSchema, layer: int, hf_layer: str, moe_prefix: str, n_experts: int, inter: int,
                hidden: int, names: tuple[str, str, str], fused: bool) -> None:
    """Per-expert tensors (`experts.7.gate_proj.weight`) or transformers 5's fused `experts.gate_up_proj [E, 2I, H]`."""
    for e in range(n_experts):
        key = UnitKey(layer, "expert", e)
        if fused:
            base = f"{hf_layer}{moe_prefix}.experts."
            schema.add(key, "gate_up", TensorSpec(base + "gate_up_proj", (2 * inter, hidden), index=e))
            schema.add(key, "down", TensorSpec(base + "down_proj", (hidden, inter), index=e))
        else:
            add_gated_mlp(schema, key, f"{hf_layer}{moe_prefix}.experts.{e}.", "", inter, hidden, names)


class StandardNaming:
    """Pre-norm decoder: RMSNorm -> GQA attention with RoPE -> RMSNorm -> (gated MLP | routed experts): its args
    (config.json parsed and checked) and its tensors (the naming table)."""

    def __init__(self, name: str, args_fn):
        self.name = name
        self._args_fn = args_fn

    def args(self, spec: ModelSpec) -> DecoderArgs:
        return self._args_fn(spec)

    def schema(self, a: DecoderArgs, fused_experts: bool = False) -> ModelSchema:
        s, schema = a.spec, ModelSchema()
        H, D = s.hidden_size, s.head_dim
        add_embed_and_head(schema, s)
        for l in range(s.num_layers):
            key, p = UnitKey(l, "dense"), f"model.layers.{l}."

            def add(local: str, shape: tuple[int, ...]) -> None:
                schema.add(key, local, TensorSpec(p + local, shape))

            add("input_layernorm.weight", (H,))
            add("post_attention_layernorm.weight", (H,))
            for proj, out in (("q", s.num_heads * D), ("k", s.num_kv_heads * D), ("v", s.num_kv_heads * D)):
                add(f"self_attn.{proj}_proj.weight", (out, H))
                if a.qkv_bias:
                    add(f"self_attn.{proj}_proj.bias", (out,))
            add("self_attn.o_proj.weight", (H, s.num_heads * D))
            if a.o_bias:
                add("self_attn.o_proj.bias", (H,))
            if a.qk_norm:
                add("self_attn.q_norm.weight", (D,))
                add("self_attn.k_norm.weight", (D,))
            if l in a.moe_layers:
                # transformers 5's fused layout puts every family's MoE block under "mlp" (Mixtral included)
                moe = "mlp" if fused_experts else a.moe_prefix
                schema.add(key, "router", TensorSpec(f"{p}{moe}.gate.weight", (s.num_experts, H)))
                if a.shared_intermediate_size:
                    add_gated_mlp(schema, key, f"{p}{moe}.shared_expert.", "shared.", a.shared_intermediate_size, H)
                    schema.add(key, "shared_gate", TensorSpec(f"{p}{moe}.shared_expert_gate.weight", (1, H)))
                add_experts(schema, l, p, moe, s.num_experts, a.moe_intermediate_size, H, a.expert_names,
                            fused_experts)
            else:
                add_gated_mlp(schema, key, f"{p}mlp.", "mlp.", s.intermediate_size, H)
        return schema
