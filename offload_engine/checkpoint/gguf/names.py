"""The Hugging Face tensor names the architectures' schemas use -> llama.cpp's GGUF names (gguf/constants.py
TENSOR_NAMES, as convert_hf_to_gguf.py maps them). Routed experts are one fused GGUF tensor per projection
(`blk.N.ffn_gate_exps.weight` [E, I, H]) whose outermost dimension is the expert: an expert is an index into it.
"""
from __future__ import annotations

import re

TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
         # DeepSeek MLA
         "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
         "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "kv_b_proj": "attn_kv_b"}
_FFN = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # Mixtral's names
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def _layer_name(rest: str) -> str | None:
    fixed = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
             "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
    if rest in fixed:
        return fixed[rest]
    module, _, leaf = rest.rpartition(".")
    if module.startswith("self_attn.") and module[10:] in _ATTN:
        return f"{_ATTN[module[10:]]}.{leaf}"
    for prefix, suffix in (("mlp.", ""), ("mlp.shared_expert.", "_shexp"), ("mlp.shared_experts.", "_shexp")):
        proj = module.removeprefix(prefix)
        if module.startswith(prefix) and proj in _FFN:
            return f"{_FFN[proj]}{suffix}.{leaf}"
    return None


def gguf_name(hf_name: str) -> tuple[str, int | None] | None:
    """(GGUF tensor name, expert index or None) for a schema's tensor name; None when llama.cpp has no name."""
    if hf_name in TOP:
        return TOP[hf_name], None
    m = LAYER.match(hf_name)
    if m is None:
        return None
    layer, rest = m.group(1), m.group(2)
    e = EXPERT.match(rest)
    if e is not None:
        proj = _EXPERT.get(e.group(2))
        return (f"blk.{layer}.{proj}.weight", int(e.group(1))) if proj else None
    name = _layer_name(rest)
    return (f"blk.{layer}.{name}", None) if name else None
