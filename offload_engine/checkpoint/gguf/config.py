"""GGUF metadata -> a config.json-shaped dict, so the architectures parse it as they parse a folder's.

Keys are llama.cpp's (`<arch>.block_count`, `<arch>.embedding_length`, ...; gguf/constants.py `Keys.LLM`). Some
facts are in the tensors, not the metadata, and are read from their presence: tied embeddings (no
`output.weight`), attention biases, which MoE layers are dense, Llama 3's rope scaling (`rope_freqs.weight`,
the per-frequency divisors, read here: a few hundred bytes).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from ...errors import CheckpointFormatError, ConfigError, OffloadEngineError
from ...formats.gguf import GGUF_NATIVE_TYPES
from . import gpt_oss, hybrid
from .reader import GGUFFile

# general.architecture -> the engine's model_type (llama with experts is Mixtral, as llama.cpp writes it)
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
         "deepseek2": "deepseek_v3", "gpt-oss": "gpt_oss"}
ARCHS.update(hybrid.ARCHS)  # qwen3next, qwen35moe (hybrid.py)
PLAIN_TYPES = ("F32", "F16", "BF16")


def model_type(g: GGUFFile) -> str:
    arch = g.get("general.architecture")
    if arch not in ARCHS:
        raise ConfigError(f"{g.path}: GGUF architecture {arch!r} is not supported; supported: "
                          f"{', '.join(sorted(ARCHS))}")
    if arch == "llama" and (g.get("llama.expert_count") or 0) > 0:
        return "mixtral"
    return ARCHS[arch]


class _Meta:
    def __init__(self, g: GGUFFile):
        self.g, self.arch = g, g.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.g.get(f"{self.arch}.{key}")
        if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv): the engine needs them uniform
            if len(set(value)) != 1:
                raise ConfigError(f"{self.g.path}: {self.arch}.{key} varies by layer ({value[:8]}...), which the "
                                  f"engine does not support")
            value = value[0]
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointFormatError(self.g.path, f"metadata key {self.arch}.{key} missing")
        return value


def _has(g: GGUFFile, suffix: str) -> bool:
    return any(name.endswith(suffix) for name in g.tensors)


def _rope_freqs(g: GGUFFile) -> list[float]:
    t = g.tensors["rope_freqs.weight"]
    if t.gtype != "F32" or len(t.shape) != 1:
        raise CheckpointFormatError(g.path, f"rope_freqs is {t.gtype} {list(t.shape)}, expected F32 [dim/2]",
                                    tensor=t.name)
    with open(t.file, "rb") as f:
        f.seek(t.offset)
        return np.frombuffer(f.read(t.nbytes), dtype="<f4").astype(float).tolist()


def _rope(m: _Meta, g: GGUFFile) -> dict[str, Any]:
    kind = m.get("rope.scaling.type", "none")
    if "rope_freqs.weight" in g.tensors:  # Llama 3: llama.cpp divides each frequency by its stored factor
        return {"rope_type": "freq_factors", "factors": _rope_freqs(g)}
    if kind in ("none", None):
        return {}
    factor = float(m.need("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": int(m.need("rope.scaling.original_context_length")),
               "beta_fast": float(m.get("rope.scaling.yarn_beta_fast", 32.0)),
               "beta_slow": float(m.get("rope.scaling.yarn_beta_slow", 1.0))}
        log_mul = m.get("rope.scaling.yarn_log_multiplier")
        if log_mul:  # deepseek2 stores 0.1 * mscale_all_dim (mscale equal to it in every release)
            out["mscale"] = out["mscale_all_dim"] = round(float(log_mul) / 0.1, 6)
        return out
    raise ConfigError(f"{g.path}: rope scaling type {kind!r} is not supported; supported: none, linear, yarn")


def compute_dtype(g: GGUFFile) -> str:
    """config.json's dtype (the CPU's compute dtype where it multiplies bf16 well: runtime/devices.py resolve_dtype):
    bfloat16 where every quantized tensor is of a type the native kernels read in place (its weights then never
    dequantized), float32 otherwise (plain files, other types: what the parity tests compare)."""
    quantized = {t.gtype for t in g.tensors.values() if t.gtype not in PLAIN_TYPES}
    return "bfloat16" if quantized and quantized <= set(GGUF_NATIVE_TYPES) else "float32"


def _dense_layers(g: GGUFFile, layers: int) -> list[int]:
    return [l for l in range(layers) if f"blk.{l}.ffn_gate_inp.weight" not in g.tensors]


def build_config(g: GGUFFile) -> dict[str, Any]:
    """config.json fields for `g`'s architecture, from its metadata and tensor names."""
    try:
        return _build(g)
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as e:
        if isinstance(e, OffloadEngineError):
            raise
        raise CheckpointFormatError(g.path, f"metadata of the wrong type or shape ({type(e).__name__}: {e})") from None


def _build(g: GGUFFile) -> dict[str, Any]:
    mt, m = model_type(g), _Meta(g)
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise CheckpointFormatError(g.path, "tensor token_embd.weight missing", tensor="token_embd.weight")
    heads, layers = int(m.need("attention.head_count")), int(m.need("block_count"))
    hidden = int(m.need("embedding_length"))
    cfg: dict[str, Any] = {
        "model_type": mt, "architectures": [f"GGUF {g.get('general.architecture')}"], "vocab_size": embd.shape[0], "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(m.get("attention.head_count_kv", heads)),
        "intermediate_size": int(m.get("feed_forward_length", 4 * hidden)),
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(m.get("context_length", 4096)), "rope_theta": float(m.get("rope.freq_base",
                                                                                                 10000.0)),
        "tie_word_embeddings": "output.weight" not in g.tensors, "dtype": compute_dtype(g), "hidden_act": "silu",
        "bos_token_id": g.get("tokenizer.ggml.bos_token_id"), "eos_token_id": g.get("tokenizer.ggml.eos_token_id"),
    }
    if mt != "deepseek_v3" and m.get("attention.key_length"):
        cfg["head_dim"] = int(m.get("attention.key_length"))
    if rope := _rope(m, g):
        cfg["rope_scaling"] = rope
    _check_counts(g, m, layers, hidden, embd)
    bias = _has(g, ".attn_q.bias")
    cfg["attention_bias"] = bias
    experts = int(m.get("expert_count", 0))
    moe = dict(num_experts=experts, num_experts_per_tok=int(m.get("expert_used_count", 0)),
               moe_intermediate_size=int(m.get("expert_feed_forward_length", 0)))
    if mt == "mixtral":
        cfg.update(num_local_experts=experts, num_experts_per_tok=moe["num_experts_per_tok"])
    elif mt == "qwen3_moe":
        cfg.update(moe, mlp_only_layers=_dense_layers(g, layers), decoder_sparse_step=1,
                   norm_topk_prob=bool(m.get("expert_weights_norm", True)))
    elif mt == "qwen2_moe":
        cfg.update(moe, mlp_only_layers=_dense_layers(g, layers), decoder_sparse_step=1, norm_topk_prob=False,
                   shared_expert_intermediate_size=int(m.get("expert_shared_feed_forward_length", 0)))
    elif mt == "deepseek_v3":
        cfg.update(_deepseek(m, g, heads))
    elif mt == "gpt_oss":  # sliding layers, expert width, YaRN untruncated: checkpoint/gguf/gpt_oss.py
        cfg.update(gpt_oss.config(g, cfg))
    elif mt in hybrid.MODEL_TYPES:
        cfg.update(hybrid.config(g, cfg))
    return cfg


def _check_counts(g: GGUFFile, m: _Meta, layers: int, hidden: int, embd) -> None:
    """The counts the schema loops over agree with the tensors (a corrupt block_count or expert_count would
    otherwise describe billions of units)."""
    seen = {int(x.group(1)) for name in g.tensors if (x := re.match(r"blk\.(\d+)\.", name))}
    if layers != (max(seen) + 1 if seen else 0):
        raise CheckpointFormatError(g.path, f"{m.arch}.block_count={layers} but the tensors are of "
                                            f"{max(seen) + 1 if seen else 0} blocks")
    if embd.shape[-1] != hidden or len(embd.shape) != 2:
        raise CheckpointFormatError(g.path, f"token_embd.weight {list(embd.shape)} disagrees with "
                                            f"{m.arch}.embedding_length={hidden}", tensor=embd.name)
    experts, used = int(m.get("expert_count", 0)), int(m.get("expert_used_count", 0))
    fused = [t for name, t in g.tensors.items() if name.endswith("ffn_gate_exps.weight")]
    if (experts or fused) and (not fused or any(t.shape[0] != experts for t in fused) or not 0 < used <= experts):
        raise CheckpointFormatError(g.path, f"{m.arch}.expert_count={experts} (used {used}) disagrees with the "
                                            f"expert tensors ({[list(t.shape) for t in fused[:2]]})")


def _deepseek(m: _Meta, g: GGUFFile, heads: int) -> dict[str, Any]:
    gating = m.get("expert_gating_func")  # 1 softmax (DeepSeek-V2), 2 sigmoid (V3, Kimi K2)
    if gating == 1 or (gating is None and not _has(g, ".exp_probs_b.bias")):
        raise ConfigError(f"{g.path}: deepseek2 with softmax expert gating (DeepSeek-V2) is not supported; "
                          f"supported: sigmoid gating with exp_probs_b (DeepSeek-V3, Kimi K2)")
    rope_dim = int(m.need("rope.dimension_count"))
    qk = int(m.get("attention.key_length_mla") or m.need("attention.key_length"))
    v = int(m.get("attention.value_length_mla") or m.need("attention.value_length"))
    q_lora = m.get("attention.q_lora_rank")
    return {"num_key_value_heads": heads, "q_lora_rank": int(q_lora) if q_lora else None,
            "kv_lora_rank": int(m.need("attention.kv_lora_rank")), "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": qk - rope_dim, "v_head_dim": v,
            "n_routed_experts": int(m.get("expert_count", 0)), "num_experts_per_tok": int(m.get("expert_used_count", 0)),
            "moe_intermediate_size": int(m.need("expert_feed_forward_length")),
            "n_shared_experts": int(m.get("expert_shared_count", 0)),
            "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
            "n_group": int(m.get("expert_group_count", 1)), "topk_group": int(m.get("expert_group_used_count", 1)),
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_interleave": True,
            "num_nextn_predict_layers": 0}


def file_format(g: GGUFFile) -> tuple[str, str | None]:
    """(dtype, nearest --weights what-if or None) of the file's general.file_type, for the planner, which sizes
    a model from its config: F32/F16/BF16 files as such, MXFP4_MOE as mxfp4 experts, Q8_0 as int8, the 4-6 bit
    types as int4 (an estimate: `run` places the units by the file's real bytes)."""
    from gguf import LlamaFileType

    raw = g.get("general.file_type")
    try:
        name = LlamaFileType(raw).name if raw is not None else "ALL_F32"
    except ValueError:
        name = "UNKNOWN"
    if name.endswith("BF16"):
        return "bfloat16", None
    if name.endswith("F16"):
        return "float16", None
    if name.endswith("F32"):
        return "float32", None
    if "MXFP4" in name:  # MOSTLY_MXFP4_MOE (gpt-oss): MXFP4 experts, the rest sized as the releases' bf16
        return "bfloat16", "mxfp4"
    return "bfloat16", "int8" if "Q8" in name else "int4"
