#!/usr/bin/env python3
"""Write a GGUF file (or split set) from a small Hugging Face folder with the `gguf` package's GGUFWriter, as
llama.cpp's convert_hf_to_gguf.py does: its tensor names (gguf.TensorNameMap), its metadata keys, Llama's q/k
rope permutation, routed experts stacked into one [E, ...] tensor per projection, DeepSeek's kv_b_proj split into
k_b (transposed) and v_b. Tensor types: F32, F16, BF16, Q8_0, Q4_0 quantized by `gguf.quants`; Q4_K, Q5_K, Q6_K
and IQ4_XS (which `gguf.quants` cannot quantize) as random valid blocks: the tests compare against the `gguf`
package's own dequantization of what was written, not against the source weights.

    python tools/gguf_from_hf.py MODEL_DIR OUT.gguf [--type Q8_0] [--split-tensors N]

Test tooling: mirrors the converter for the architectures the engine runs; the real converter is
tools/llamacpp_convert.py.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {"llama": "LLAMA", "mixtral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "qwen2_moe": "QWEN2MOE",
        "qwen3_moe": "QWEN3MOE", "deepseek_v3": "DEEPSEEK2"}
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
RANDOM_BLOCKS = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# offsets of the f16 scale fields of each random-block type, and the range drawn for them: the decoded weights
# come out ~0.05 in magnitude (as the source models'), so a random model still has varied greedy output
SCALE_FIELDS = {"Q4_K": ((0, 2), (1e-4, 4e-4)), "Q5_K": ((0, 2), (5e-5, 2e-4)), "Q6_K": ((208,), (3e-5, 1e-4)),
                "IQ4_XS": ((0,), (1e-4, 4e-4))}


def _permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(folder: Path, cfg: dict) -> dict[str, torch.Tensor]:
    """The folder's tensors, renamed and reshaped as the converter writes them (HF names, before mapping)."""
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw.update(load_file(f))
    mt, heads = cfg["model_type"], cfg["num_attention_heads"]
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in raw.items():
        t = t.float()
        m = re.match(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m.group(3), m.group(3))
            experts.setdefault((int(m.group(1)), proj), {})[int(m.group(2))] = t
            continue
        if mt in ("llama", "mixtral") and name.endswith("q_proj.weight"):
            t = _permute(t, heads, heads)
        elif mt in ("llama", "mixtral") and name.endswith("k_proj.weight"):
            t = _permute(t, heads, cfg.get("num_key_value_heads", heads))
        if name.endswith("kv_b_proj.weight"):
            nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            k_b, v_b = t.view(heads, nope + v, -1).split([nope, v], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2).contiguous()
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b.contiguous()
            continue
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        out[name] = t
    if (rope := _rope_factors(cfg)) is not None:
        out["rope_freqs.weight"] = rope
    for (layer, proj), by_expert in sorted(experts.items()):
        out[f"model.layers.{layer}.mlp.experts.{proj}.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _rope_factors(cfg: dict) -> torch.Tensor | None:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3's rope scaling as per-frequency factors."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) != "llama3":
        return None
    base = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            factors.append(1)
        elif wavelen > old / lo:
            factors.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _metadata(w, cfg: dict, n_tensors_names: set[str]) -> None:
    mt = cfg["model_type"]
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if mt == "deepseek_v3" else cfg.get("num_key_value_heads", heads))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    if mt != "deepseek_v3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "yarn":
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32)))
        w.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1)))
        if mt == "deepseek_v3" and rope.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if mt == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if mt == "deepseek_v3":
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(cfg["kv_lora_rank"])
        w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        w.add_value_length(cfg["kv_lora_rank"])
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))
        w.add_expert_gating_func(__import__("gguf").ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg.get("n_group", 1))
        w.add_expert_group_used_count(cfg.get("topk_group", 1))
        w.add_rope_dimension_count(cfg["qk_rope_head_dim"])


def _tokenizer(w, folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab.update(special)
    tokens = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)])
    w.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(special[tcfg["bos_token"]])
    w.add_eos_token_id(special[tcfg["eos_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])


def encode_tensor(t: np.ndarray, gtype: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    import gguf

    qt = gguf.GGMLQuantizationType[gtype]
    if gtype == "F32":
        return t.astype(np.float32), qt
    if gtype == "F16":
        return t.astype(np.float16), qt
    if gtype in QUANTIZABLE:
        return gguf.quants.quantize(t.astype(np.float32), qt), qt
    per, size = gguf.GGML_QUANT_SIZES[qt]
    blocks = rng.integers(0, 256, size=(t.size // per, size), dtype=np.uint8)
    fields, (lo, hi) = SCALE_FIELDS.get(gtype, ((), (0, 0)))
    for at in fields:  # small positive f16 scales: finite weights of a usable magnitude
        blocks[:, at:at + 2] = rng.uniform(lo, hi, size=(blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    if gtype in ("Q4_K", "Q5_K"):  # each sub-block's min equal to its scale and dmin = d x mid-level: zero mean
        blocks[:, 8:12] = blocks[:, 4:8]
        blocks[:, 12:16] = (blocks[:, 12:16] & 0x0F) * 0x11
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        blocks[:, 2:4] = (d * (7.5 if gtype == "Q4_K" else 15.5)).astype(np.float16).view(np.uint8)
    return blocks.reshape(*t.shape[:-1], t.shape[-1] // per * size), qt


def write_gguf(folder: str | Path, out: str | Path, gtype: str = "F32", split_tensors: int = 0,
               seed: int = 0, override: dict[str, str] | None = None) -> list[Path]:
    """Write `folder` as GGUF: matrices whose rows are whole blocks in `gtype`, the rest in F32 as llama.cpp keeps
    them; `override` gives some GGUF tensors another type (any ggml type: the bad-input tests write types the
    engine refuses, as random bytes). Returns the files written."""
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    arch = gguf.MODEL_ARCH[ARCH[cfg["model_type"]]]
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    # dense layers of a Qwen-MoE (mlp_only_layers), which llama.cpp's MoE archs do not name: the generic names
    generic = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_tensors)
    tensors = _tensors(folder, cfg)
    _metadata(w, cfg, set(tensors))
    _tokenizer(w, folder)
    w.add_file_type(0 if gtype == "F32" else 1)
    rng = np.random.default_rng(seed)
    for name, t in tensors.items():
        stem, suffix = (name[:-5], ".bias") if name.endswith(("_bias", ".bias")) else (name.removesuffix(".weight"),
                                                                                      ".weight")
        if name == "rope_freqs.weight":
            w.add_tensor(name, t.numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
            continue
        mapped = names.get_name(stem) or generic.get_name(stem)
        if mapped is None:
            raise ValueError(f"no GGUF name for {name}")
        kind = gtype if t.ndim >= 2 and t.shape[-1] % 32 == 0 and (
            gtype not in RANDOM_BLOCKS or t.shape[-1] % 256 == 0) else "F32"
        kind = (override or {}).get(mapped + suffix, kind)
        data, qt = encode_tensor(t.numpy(), kind, rng)
        w.add_tensor(mapped + suffix, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_tensors:
        return sorted(out.parent.glob(out.stem + "-*-of-*.gguf"))
    return [out]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="F32", choices=QUANTIZABLE + RANDOM_BLOCKS)
    ap.add_argument("--split-tensors", type=int, default=0, help="at most N tensors per file (a split set)")
    a = ap.parse_args(argv)
    for f in write_gguf(a.model, a.out, a.type, a.split_tensors):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
