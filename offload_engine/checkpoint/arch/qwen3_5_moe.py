"""Qwen3.5-MoE and Qwen3.6-MoE (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B, 122B-A10B, 397B-A17B): the text part.

Same hybrid decoder as Qwen3-Next (qwen3_next.py) with three differences: the DeltaNet's input projections are
separate (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), every layer is MoE, and top-k weights are always
renormalized. Released checkpoints are vision-language models (`Qwen3_5MoeForConditionalGeneration`,
model_type "qwen3_5_moe"): the language model's fields sit under `text_config`, its tensors under
`model.language_model.`, routed experts are fused `[E, 2I, H]` / `[E, H, I]` tensors, and the vision tower
(`model.visual.*`) is ignored here: prompts are text only, so positions are 1-D and the interleaved M-RoPE
sections (`mrope_section`) all reduce to plain partial RoPE. transformers' text-only class
(`Qwen3_5MoeForCausalLM`, model_type "qwen3_5_moe_text") saves the same model with a flat config and `model.` names.
"""
from ..hf_config import ModelSpec
from .qwen3_next import HybridArgs, HybridNaming, hybrid_args

WRAPPED = {"qwen3_5_moe": "model.language_model."}  # vision-language releases: where the text model's tensors are


def _args(spec: ModelSpec) -> HybridArgs:
    every_layer = frozenset(range(spec.num_layers)) if spec.num_experts else frozenset()
    return hybrid_args(spec, moe_layers=every_layer, norm_topk_prob=True, split_projections=True,
                       prefix=WRAPPED.get(spec.model_type, "model."))


NAMING = HybridNaming("qwen3_5_moe", _args)
