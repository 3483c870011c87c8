#!/usr/bin/env python3
"""Write random-weight Hugging Face checkpoints for tests and benchmarks.

The weights come from transformers' own model classes (``save_pretrained``,
safetensors), so the files are byte-for-byte what the hub tooling produces; the
tokenizer is a small byte-level BPE trained on the local Python stdlib source,
which every machine has offline.

    python tools/make_checkpoint.py --arch qwen3_moe --preset small --out .cache/demo-model

Hybrid archs (qwen3_next, qwen3_5_moe) also get multi-token-prediction tensors (`mtp.*`: one MTP layer as in their
releases, or `--mtp N`), which transformers' classes neither build nor load: they are made from a one-layer model of
the same config and saved under the released names; deepseek_v3 gets MTP layers only with `--mtp N`. qwen3_5_moe is
written like its releases, a vision-language checkpoint (nested `text_config`, `model.language_model.*`, fused
experts, a token vision tower); qwen3_5_moe_text is transformers' text-only save of the same model (flat config,
`model.*`).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

try:
    from tools.quant_writers import QUANTS, QuantOptions, quantize_folder
except ModuleNotFoundError:  # run as a script: tools/ is on sys.path, the repo root may not be
    from quant_writers import QUANTS, QuantOptions, quantize_folder  # type: ignore[no-redef]

ARCHS = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen3_next",
         "qwen3_5_moe_text", "gpt_oss")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen3_next", "qwen3_5_moe_text", "gpt_oss")
# Released as vision-language checkpoints: nested text_config, language model under model.language_model.*
VLM_ARCHS = ("qwen3_5_moe",)
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")  # Gated DeltaNet + gated attention, with MTP
FUSED_RELEASES = ("qwen3_5_moe", "gpt_oss")  # archs whose releases store routed experts fused (gpt-oss: always)
ZERO_CENTERED_NORMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "norm.weight")
EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML plus a Qwen3-style tools section (without Qwen3's thinking): offered tools in the system turn, calls as
# <tool_call>{"name", "arguments"}</tool_call>, results as <tool_response> in a user turn. Messages without tools
# render exactly as plain ChatML.
CHATML = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set call = call['function'] if call['function'] else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Preset:
    vocab: int  # target BPE vocab; the model's vocab_size is the trained tokenizer's real size
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (dense archs and leading dense layers of MoE archs)
    experts: int
    top_k: int
    moe_intermediate: int
    dense_layers: int  # leading dense layers in MoE archs that support them
    max_pos: int
    init_range: float  # 0.02 makes greedy output near-constant at these widths (checked in tests)
    shard: str  # default max_shard_size: tiny is split so the sharded-index path is always exercised


PRESETS: dict[str, Preset] = {
    # Parity tests: every code path (dense + MoE layer, GQA, sharded index) at negligible size.
    "tiny": Preset(vocab=512, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                   experts=8, top_k=2, moe_intermediate=32, dense_layers=1, max_pos=512, init_range=0.2,
                   shard="200KB"),
    # Offload tests: experts ~97% of bytes, so budgets of 10-25% of the model still hold the minimum working set.
    "offload": Preset(vocab=512, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                      experts=64, top_k=4, moe_intermediate=128, dense_layers=0, max_pos=512, init_range=0.2,
                      shard="4MB"),
    # Memory tests: ~110 MB, experts ~92%, so a 25% budget is far above the minimum working set and far below
    # the model, and the process's real memory shows whether the budget holds.
    "medium": Preset(vocab=512, hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, intermediate=1024,
                     experts=64, top_k=4, moe_intermediate=64, dense_layers=0, max_pos=512, init_range=0.05,
                     shard="50MB"),
    # Demo model: a few tens of MB.
    "small": Preset(vocab=4096, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768,
                    experts=16, top_k=4, moe_intermediate=128, dense_layers=1, max_pos=2048, init_range=0.1,
                    shard="20MB"),
    # Qwen3-MoE-like, no dense layers: ~2.6 GB float32, experts ~90% of bytes for MoE archs.
    "bench": Preset(vocab=8192, hidden=1024, layers=12, heads=16, kv_heads=4, head_dim=64, intermediate=12288,
                    experts=64, top_k=8, moe_intermediate=256, dense_layers=0, max_pos=4096, init_range=0.05,
                    shard="1GB"),
}

_TOKENIZERS: dict[int, Any] = {}  # vocab size -> trained tokenizers.Tokenizer (training is the slow part)


def _corpus(cap_bytes: int) -> list[str]:
    """A fixed, sorted slice of the stdlib source: identical on every run of one machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= cap_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """Byte-level BPE with ChatML specials; `texts` defaults to a fixed slice of the stdlib (cached per size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if texts is not None or vocab_size not in _TOKENIZERS:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOT, IM_START, IM_END], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        # ~400 bytes of text per token is plenty for these merges and keeps training well under 2 s.
        tok.train_from_iterator(texts if texts is not None else _corpus(min(3 << 20, 400 * vocab_size)),
                                trainer=trainer)
        if texts is not None:
            return tok
        _TOKENIZERS[vocab_size] = tok
    return _TOKENIZERS[vocab_size]


def arch_config(arch: str, p: Preset, vocab: int, eot: int, mtp_layers: int = 1):
    """The arch's own config class, fed the field names its released hub configs use (mtp_layers: hybrids'
    `mtp_num_hidden_layers`)."""
    import transformers as tf

    kw: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=p.hidden, num_hidden_layers=p.layers, num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads, intermediate_size=p.intermediate, max_position_embeddings=p.max_pos,
        initializer_range=p.init_range, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
    )
    moe = dict(num_experts=p.experts, num_experts_per_tok=p.top_k, moe_intermediate_size=p.moe_intermediate)
    if arch == "llama":  # llama3 rope scaling exercises the frequency-dependent rope path
        kw.update(head_dim=p.head_dim, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": p.max_pos // 8})
        return tf.LlamaConfig(**kw)
    if arch == "qwen2":  # q/k/v biases are built in
        return tf.Qwen2Config(**kw)  # head_dim = hidden / heads
    if arch == "qwen3":  # tied lm_head exercises the shared-weight path
        return tf.Qwen3Config(**{**kw, "tie_word_embeddings": True}, head_dim=p.head_dim)
    if arch == "mixtral":  # every layer is MoE; expert width is `intermediate_size`
        return tf.MixtralConfig(**{**kw, "intermediate_size": p.moe_intermediate}, head_dim=p.head_dim,
                                num_local_experts=p.experts, num_experts_per_tok=p.top_k)
    dense = list(range(p.dense_layers))
    if arch == "qwen2_moe":  # shared expert + sigmoid gate, softmax top-k without renormalisation
        return tf.Qwen2MoeConfig(**kw, **moe, shared_expert_intermediate_size=2 * p.moe_intermediate,
                                 mlp_only_layers=dense, decoder_sparse_step=1, norm_topk_prob=False)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**kw, **moe, head_dim=p.head_dim, mlp_only_layers=dense,
                                 decoder_sparse_step=1, norm_topk_prob=True)
    if arch == "deepseek_v3":  # MLA + grouped sigmoid routing + YaRN, as in the released config
        n_group = min(8, p.experts // 2)
        kw.update(num_key_value_heads=p.heads, rope_scaling={
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": p.max_pos // 4,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
        return tf.DeepseekV3Config(
            **kw, n_routed_experts=p.experts, num_experts_per_tok=p.top_k, moe_intermediate_size=p.moe_intermediate,
            n_shared_experts=1, n_group=n_group, topk_group=n_group // 2, first_k_dense_replace=p.dense_layers,
            routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=p.hidden // 2, kv_lora_rank=p.hidden // 2,
            qk_nope_head_dim=p.head_dim, qk_rope_head_dim=p.head_dim // 2, v_head_dim=p.head_dim,
            # as the releases' config.json says: transformers implies them and does not save them otherwise, and
            # without them llama.cpp's converter leaves the GGUF's gating at deepseek2's softmax
            scoring_func="sigmoid", topk_method="noaux_tc")
    if arch in HYBRID_ARCHS:
        return hybrid_config(arch, p, kw, moe, dense, mtp_layers)
    if arch == "gpt_oss":  # sinks, biases, clamped SwiGLU, YaRN; a 4-position window so short prompts slide
        kw.pop("rope_theta")
        return tf.GptOssConfig(**{**kw, "intermediate_size": p.moe_intermediate}, head_dim=p.head_dim,
                               num_local_experts=p.experts, num_experts_per_tok=p.top_k, sliding_window=4,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": p.max_pos // 4})
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS + VLM_ARCHS}")


def hybrid_config(arch: str, p: Preset, kw: dict[str, Any], moe: dict[str, Any], dense: list[int],
                  mtp_layers: int = 1):
    """Qwen3-Next / Qwen3.5-MoE: a full-attention layer every few linear ones (as many kinds as the depth allows),
    grouped DeltaNet heads (2 value heads per key head, dv = 2 dk so no shape is ambiguous), 25% partial rotary."""
    import transformers as tf

    every = max(2, min(4, p.layers - 1))
    text = dict(kw, **moe, head_dim=p.head_dim, partial_rotary_factor=0.25,
                shared_expert_intermediate_size=2 * p.moe_intermediate, mtp_num_hidden_layers=mtp_layers,
                layer_types=["full_attention" if (l + 1) % every == 0 else "linear_attention" for l in range(p.layers)],
                linear_num_key_heads=max(1, p.heads // 2), linear_num_value_heads=2 * max(1, p.heads // 2),
                linear_key_head_dim=p.head_dim, linear_value_head_dim=2 * p.head_dim, linear_conv_kernel_dim=4)
    if arch == "qwen3_next":
        return tf.Qwen3NextConfig(**text, mlp_only_layers=dense, decoder_sparse_step=1, norm_topk_prob=True)
    text.pop("intermediate_size")  # Qwen3.5-MoE has no dense MLP layers
    if arch == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig(**text)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=p.hidden, patch_size=2,
                  temporal_patch_size=1, num_position_embeddings=4)  # a token tower: the engine ignores it
    return tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def build_model(arch: str, p: Preset, vocab: int, eot: int, seed: int, dtype: torch.dtype, mtp_layers: int = 1):
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3_5MoeForConditionalGeneration

    config = arch_config(arch, p, vocab, eot, mtp_layers)
    torch.manual_seed(seed)  # transformers' _init_weights draws from the global RNG
    if arch in VLM_ARCHS:  # AutoModelForCausalLM would build the text-only class
        model = Qwen3_5MoeForConditionalGeneration._from_config(config, dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        # Zero correction bias would leave DeepSeek's bias-for-selection path untested.
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
    if arch in HYBRID_ARCHS:
        _perturb_norms(model, gen)
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    return model


def _perturb_norms(model, gen: torch.Generator) -> None:
    """Zero-centred norms start at 0 (scale 1 + w): random offsets make a w-vs-(1 + w) mix-up visible."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(ZERO_CENTERED_NORMS):
                param.add_((0.1 * torch.randn(param.shape, generator=gen)).to(param.dtype))


def mtp_tensors(arch: str, model, seed: int) -> dict[str, torch.Tensor]:
    """The MTP module under its released names: fc [H, 2H], three norms and `mtp_num_hidden_layers` full-attention
    MoE layers (built by transformers as one-layer models of the same config; experts fused like its internals)."""
    from transformers import AutoModelForCausalLM

    text = model.config.text_config if arch in VLM_ARCHS else model.config
    n, H = int(getattr(text, "mtp_num_hidden_layers", 0) or 0), text.hidden_size
    if not n:
        return {}
    one = copy.deepcopy(text)
    one.num_hidden_layers, one.layer_types = 1, ["full_attention"]
    if getattr(one, "mlp_only_layers", None):
        one.mlp_only_layers = []
    gen = torch.Generator().manual_seed(seed + 2)
    dtype = model.dtype
    out = {"mtp.fc.weight": (text.initializer_range * torch.randn((H, 2 * H), generator=gen)).to(dtype)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = (0.1 * torch.randn(H, generator=gen)).to(dtype)
    for i in range(n):
        torch.manual_seed(seed + 3 + i)
        block = AutoModelForCausalLM.from_config(one, dtype=dtype)
        _perturb_norms(block, gen)
        prefix = "model.layers.0."
        out.update({f"mtp.layers.{i}.{k[len(prefix):]}": v.detach().clone() for k, v in block.state_dict().items()
                    if k.startswith(prefix)})
    return out


def deepseek_mtp_tensors(model, n: int, seed: int) -> dict[str, torch.Tensor]:
    """`--mtp N` for deepseek_v3: N MTP layers under the released names (DeepSeek-V3 / Kimi K2 / GLM-4.5):
    model.layers.{L + i}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,embed_tokens} plus a full MoE
    decoder block under the same prefix (L = num_hidden_layers; experts in transformers' internal fused form,
    which save_pretrained converts like the trunk's). The layers are transformers' own MtpModel (what
    generate(use_mtp=True) drafts with), randomly initialized; its weight conversion maps model.layers.{L + i}.*
    to layers.{i}.mtp_block.* and shared_head.norm to post_norm, and this is the reverse of that mapping."""
    from transformers.modeling_layers import MtpModel

    model.config.num_mtp_layers = n  # saved as num_nextn_predict_layers (the config's attribute_map)
    torch.manual_seed(seed + 2)
    mtp = MtpModel(model, n)
    for module in mtp.layers.modules():  # MtpModel leaves the experts and router uninitialized
        model._init_weights(module)
    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, t in mtp.state_dict().items():
            if name.startswith("layers.") and name.endswith(("norm.weight", "e_score_correction_bias")):
                t.add_((0.1 * torch.randn(t.shape, generator=gen)).to(t.dtype))  # so mix-ups show in tests
    return released_mtp_tensors(model, mtp)


def released_mtp_tensors(model, mtp) -> dict[str, torch.Tensor]:
    """A transformers MtpModel's layers under DeepSeek's released names (also used for the trained demo model)."""
    first, out = model.config.num_hidden_layers, {}
    for name, t in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue  # embed_tokens / shared_head are the main model's: written below as the released copies
        _, k, rest = name.split(".", 2)
        rest = rest.removeprefix("mtp_block.")
        rest = "shared_head.norm." + rest.removeprefix("post_norm.") if rest.startswith("post_norm.") else rest
        keep_fp32 = rest.startswith("mlp.gate.")  # the router stays float32 as in the trunk (transformers 5)
        dtype = torch.float32 if keep_fp32 else model.dtype
        out[f"model.layers.{first + int(k)}.{rest}"] = t.detach().to(dtype).clone()
    for k in range(mtp.num_mtp_layers):
        prefix = f"model.layers.{first + k}."
        out[prefix + "shared_head.head.weight"] = model.get_output_embeddings().weight.detach().clone()
        out[prefix + "embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    return out


def write_tokenizer(tok, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT, "pad_token": EOT,
        "unk_token": None, "add_bos_token": False, "model_max_length": max_len,
        "clean_up_tokenization_spaces": False, "chat_template": CHATML,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def safetensors_sizes(folder: Path) -> dict[str, int]:
    """name -> bytes, read from the shard headers (8-byte length + JSON), so it reports what was written."""
    sizes: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                sizes[name] = info["data_offsets"][1] - info["data_offsets"][0]
    return sizes


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an old one (only reached with force) is removed afterwards."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [tmp, *tmp.iterdir()]:  # mkdtemp makes 0700; give the usual umask-based modes
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old)


def make_checkpoint(arch: str, preset: str, out: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                    max_shard_size: str | int | None = None, fused_experts: bool | None = None,
                    force: bool = False, mtp: int | None = None, quant: str | None = None,
                    quant_options: QuantOptions = QuantOptions()) -> Path:
    """quant: one of tools/quant_writers.QUANTS, written from the checkpoint made (MTP layers included).
    fused_experts: None writes experts as the arch's releases do (fused for qwen3_5_moe, per expert otherwise).
    mtp: MTP layers, in the arch's released naming (deepseek_v3: model.layers.{L + i}.*; hybrids: mtp.*, and
    config.json's mtp_num_hidden_layers); None: as the releases (one for hybrids, none for deepseek_v3)."""
    if arch not in ARCHS + VLM_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS + VLM_ARCHS}")
    if fused_experts and arch not in MOE_ARCHS + VLM_ARCHS:
        raise ValueError(f"--fused-experts needs an MoE arch {MOE_ARCHS + VLM_ARCHS}, not {arch!r}")
    if mtp is not None and (not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0):
        raise ValueError(f"--mtp must be an integer >= 0, got {mtp!r}")
    if mtp and arch != "deepseek_v3" and arch not in HYBRID_ARCHS:
        raise ValueError(f"--mtp N adds multi-token-prediction layers: it needs --arch deepseek_v3 or one of "
                         f"{HYBRID_ARCHS}, not {arch!r}")
    if arch == "gpt_oss" and quant not in (None, "mxfp4"):
        raise ValueError(f"gpt_oss is released in mxfp4 only; --quant {quant} is not written for it")
    if mtp is None:
        mtp = 1 if arch in HYBRID_ARCHS else 0
    if fused_experts is None:
        fused_experts = arch in FUSED_RELEASES
    p = PRESETS[preset]
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out} exists and is not empty (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=3, desc=f"{arch}/{preset}", disable=preset != "bench")
    t0 = time.perf_counter()
    tok = train_tokenizer(p.vocab)
    eot = tok.token_to_id(EOT)
    steps.update()
    model = build_model(arch, p, tok.get_vocab_size(), eot, seed, getattr(torch, dtype), mtp_layers=mtp)
    steps.update()
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        extra = {}
        if arch in HYBRID_ARCHS:  # as many layers as config.json's mtp_num_hidden_layers (= mtp)
            extra = mtp_tensors(arch, model, seed)
        elif mtp:
            extra = deepseek_mtp_tensors(model, mtp, seed)
        # save_original_format=False keeps transformers' internal fused expert tensors instead of per-expert ones
        # (the conversion applies to the MTP layer's experts too).
        model.save_pretrained(tmp, max_shard_size=max_shard_size or p.shard, save_original_format=not fused_experts,
                              **({"state_dict": {**model.state_dict(), **extra}} if extra else {}))
        write_tokenizer(tok, tmp, p.max_pos)
        if quant is not None:
            quantize_folder(tmp, quant, quant_options)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    steps.update()
    steps.close()
    sizes = safetensors_sizes(out)
    expert = sum(b for n, b in sizes.items() if ".experts." in n)
    files = sorted(f.name for f in out.iterdir())
    n_params = model.num_parameters()  # tied weights counted once
    print(f"{out}: {arch}/{preset} {dtype} {n_params / 1e6:.2f}M params, {sum(sizes.values()) / 1e6:.1f} MB tensors"
          f" ({100 * expert / max(1, sum(sizes.values())):.1f}% experts), {len(files)} files,"
          f" {time.perf_counter() - t0:.1f}s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", required=True, choices=ARCHS + VLM_ARCHS)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--max-shard-size", default=None, help="e.g. 2MB (default: per preset)")
    ap.add_argument("--fused-experts", action="store_true", default=None,
                    help="write experts as fused [E, 2I, H] / [E, H, I] (default: as the arch's releases)")
    ap.add_argument("--mtp", type=int, default=None, metavar="N",
                    help="N multi-token-prediction layers in the arch's released naming (deepseek_v3, qwen3_next, "
                         "qwen3_5_moe[_text]; default: as the releases, 1 for the Qwen hybrids, 0 for deepseek_v3)")
    ap.add_argument("--quant", choices=QUANTS, default=None, help="write this quantized format (release names)")
    ap.add_argument("--quant-block", type=int, default=128, help="fp8-block weight_block_size (default 128)")
    ap.add_argument("--quant-group", type=int, default=32, help="ct-int4 / gptq / awq group size (default 32)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    a = ap.parse_args(argv)
    try:
        make_checkpoint(a.arch, a.preset, a.out, seed=a.seed, dtype=a.dtype, max_shard_size=a.max_shard_size,
                        fused_experts=a.fused_experts, force=a.force, mtp=a.mtp, quant=a.quant,
                        quant_options=QuantOptions(block=a.quant_block, group_size=a.quant_group))
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
