"""Quantized checkpoints (tools/make_checkpoint.py --quant) against transformers run on their dequantized weights.

The dequantized reference never touches the engine's code: compressed-tensors' own decompressor for its formats,
transformers' own MXFP4 dequantization, AutoGPTQ's QuantLinear for GPTQ v1 and AutoAWQ's dequantize_gemm for AWQ
(their releases' files, tools/quant_peers.py; where the package index cannot be reached, the layouts written out
below, with a warning), and for fp8 block and GPTQ v2 (gptqmodel's: zeros stored as they are, which AutoGPTQ does
not read) the formats' published definitions written out below. The reference weights are saved as a plain fp32
folder that transformers (and, for MTP layers, which transformers' causal LM does not run, the engine's
already-verified plain path) read.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from offload_engine import Budget, Engine
from tools import quant_peers
from tools.quant_writers import QuantOptions

PROMPT_LEN, NEW_TOKENS = 48, 16
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ---- reference dequantization ----------------------------------------------------------------------------
def fields(words: torch.Tensor, bits: int, i: int) -> torch.Tensor:
    """The i-th `bits`-wide field of each int32 word (as a non-negative integer)."""
    return (words.to(torch.int64) >> (bits * i)) & ((1 << bits) - 1)


def ref_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3's weight_dequant: W[i, j] = q[i, j] * scale_inv[i // b0, j // b1]."""
    rows = torch.arange(q.shape[0]) // block[0]
    cols = torch.arange(q.shape[1]) // block[1]
    return q.float() * scale_inv.float()[rows][:, cols]


def peer_or_none(name: str):
    try:
        return quant_peers.load(name)
    except quant_peers.QuantPeerError as e:
        warnings.warn(f"{name}: the format's own code is not available, its layout written out here is the "
                      f"reference ({e})")
        return None


def ref_gptq(qweight, qzeros, scales, g_idx, bits: int, v2: bool = False) -> torch.Tensor:
    """GPTQ v1: AutoGPTQ's own QuantLinear; v2 (or AutoGPTQ not available): the layout, below."""
    if not v2 and peer_or_none("auto_gptq_qlinear") is not None:
        return quant_peers.autogptq_dense(qweight, qzeros, scales, g_idx, bits)
    return ref_gptq_layout(qweight, qzeros, scales, g_idx, bits, v2)


def ref_gptq_layout(qweight, qzeros, scales, g_idx, bits: int, v2: bool = False) -> torch.Tensor:
    """GPTQ: qweight packs inputs along rows, qzeros outputs along columns, zeros stored minus one (v1, AutoGPTQ)
    or as they are (v2, gptqmodel)."""
    per = 32 // bits
    inp, out = qweight.shape[0] * per, qweight.shape[1]
    q = torch.empty(inp, out, dtype=torch.int64)
    for i in range(per):
        q[i::per] = fields(qweight, bits, i)
    z = torch.empty(qzeros.shape[0], out, dtype=torch.int64)
    for i in range(per):
        z[:, i::per] = fields(qzeros, bits, i)
    g = g_idx.long()
    return (scales.float()[g] * (q - (z[g] + (0 if v2 else 1))).float()).t()


def ref_awq(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """AWQ GEMM: AutoAWQ's own dequantize_gemm (or, not available, the layout below)."""
    if peer_or_none("awq_packing") is not None:
        return quant_peers.autoawq_dense(qweight, qzeros, scales, group)
    return ref_awq_layout(qweight, qzeros, scales, group)


def ref_awq_layout(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """AWQ GEMM: nibble i of word k holds column 8k + AWQ_ORDER[i]; W^T = (q - z) * s per input group."""
    def unpack(words):
        out = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
        for i in range(8):
            out[:, AWQ_ORDER[i]::8] = fields(words, 4, i)
        return out

    g = torch.arange(qweight.shape[0]) // group
    return ((unpack(qweight) - unpack(qzeros)[g]).float() * scales.float()[g]).t()


def ref_compressed_tensors(parts: dict, config: dict) -> torch.Tensor:
    """compressed-tensors' own decompressor (scales upcast to fp32 first: the reference is the exact value)."""
    from compressed_tensors.compressors import NaiveQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = next(iter(config["config_groups"].values()))
    scheme = QuantizationScheme.model_validate({k: group[k] for k in ("targets", "weights")})
    main = "weight_packed" if "weight_packed" in parts else "weight"
    if parts[main].dim() == 3:  # fused experts: one expert at a time
        return torch.stack([ref_compressed_tensors({k: v[e] for k, v in parts.items()}, config)
                            for e in range(parts[main].shape[0])])
    state = dict(parts, weight_scale=parts["weight_scale"].float())
    compressor = PackedQuantizationCompressor if main == "weight_packed" else NaiveQuantizationCompressor
    return compressor.decompress(state, scheme)["weight"].float()


def ref_mxfp4(blocks, scales, input_major: bool = False) -> torch.Tensor:
    """transformers' dequantization gives gpt-oss's [E, in, out]; other fused experts are stored [E, out, in]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    return dense.contiguous() if input_major else dense.transpose(1, 2).contiguous()


def dequantized_folder(qpath: Path, out: Path) -> Path:
    """A plain fp32 copy of a quantized folder, every weight dequantized by the references above."""
    if out.exists():
        return out
    out.mkdir(parents=True)
    config = json.loads((qpath / "config.json").read_text())
    qc = config.pop("quantization_config")
    tensors = {}
    for shard in sorted(qpath.glob("*.safetensors")):
        tensors.update(load_file(shard))
    plain = {}
    method = qc["quant_method"]
    for name, t in tensors.items():
        if method == "fp8" and t.dtype == torch.float8_e4m3fn:
            plain[name] = ref_fp8_block(t, tensors[name + "_scale_inv"], tuple(qc["weight_block_size"])) \
                if t.dim() == 2 else torch.stack([ref_fp8_block(t[e], tensors[name + "_scale_inv"][e],
                                                                tuple(qc["weight_block_size"]))
                                                  for e in range(t.shape[0])])
        elif name.endswith("_packed"):
            m = name.removesuffix("_packed")
            parts = {"weight" + s: tensors[m + s] for s in ("_packed", "_scale", "_shape", "_zero_point")
                     if m + s in tensors}
            plain[m] = ref_compressed_tensors(parts, qc)
        elif method == "compressed-tensors" and name + "_scale" in tensors:  # int- / float-quantized
            parts = {"weight" + s: tensors[name + s] for s in ("", "_scale", "_zero_point") if name + s in tensors}
            plain[name] = ref_compressed_tensors(parts, qc)
        elif name.endswith(".qweight"):
            m = name.removesuffix(".qweight")
            if method == "gptq":
                v2 = (qc.get("checkpoint_format") or qc.get("format") or "gptq") == "gptq_v2"
                plain[m + ".weight"] = ref_gptq(t, tensors[m + ".qzeros"], tensors[m + ".scales"],
                                                tensors[m + ".g_idx"], qc["bits"], v2)
            else:
                plain[m + ".weight"] = ref_awq(t, tensors[m + ".qzeros"], tensors[m + ".scales"], qc["group_size"])
        elif name.endswith("_blocks"):
            m = name.removesuffix("_blocks")
            plain[m] = ref_mxfp4(t, tensors[m + "_scales"], input_major=config["model_type"] == "gpt_oss")
        elif not name.endswith(("_scale_inv", "_scale", "_shape", "_zero_point", ".qzeros", ".scales", ".g_idx",
                                "_scales")):
            plain[name] = t.float() if t.is_floating_point() else t
    save_file({k: v.contiguous() for k, v in plain.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in qpath.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
    return out


# ---- parity ------------------------------------------------------------------------------------------------
def check_against(qpath: Path, refpath: Path, budgets=(None,)) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(refpath, dtype=torch.float32).eval()
    ids = torch.randint(0, ref.config.get_text_config().vocab_size, (PROMPT_LEN,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                eos_token_id=None)[0, PROMPT_LEN:].tolist()
    assert len(set(expected)) > 1, "degenerate random model"
    for ram in budgets:
        with Engine.open(qpath, budget=Budget(ram=ram), dtype="float32", max_context=PROMPT_LEN + NEW_TOKENS) as engine:
            ours = engine.logits(ids)
            scale, diff = theirs.abs().max().item(), (ours - theirs).abs().max().item()
            assert diff <= 1e-4 * scale, f"ram={ram}: max |diff| {diff:.3g} > 1e-4 x max|logit| {scale:.3g}"
            completion = engine.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert completion.token_ids == expected, ram
            if ram is not None:  # the budget really streamed (quantized bytes read while decoding) and held
                stats = completion.stats
                assert stats["bytes_read_disk"] > 0
                assert stats["peak_bytes"]["host"] <= stats["budget_bytes"]["host"]


CASES = [
    ("llama", "fp8-block", {}), ("qwen3_moe", "fp8-block", {}), ("qwen3_5_moe_text", "fp8-block", {}),
    ("llama", "ct-int4", {}), ("qwen3_moe", "ct-int4", {}), ("qwen3_5_moe_text", "ct-int4", {}),
    ("llama", "ct-int4", {"symmetric": False}), ("llama", "ct-int4", {"strategy": "channel"}),
    ("qwen3_moe", "ct-int8", {}), ("llama", "ct-int8", {"symmetric": False}),
    ("llama", "ct-int8", {"ct_format": "int-quantized", "symmetric": False}), ("qwen3_moe", "ct-fp8", {}),
    ("llama", "ct-fp8", {"strategy": "block", "block": 16}),
    ("deepseek_v3", "ct-fp8", {"strategy": "block", "block": 16}),
    ("llama", "gptq", {}), ("qwen3_moe", "gptq", {"desc_act": True}), ("llama", "gptq", {"bits": 8}),
    ("llama", "gptq", {"group_size": -1, "desc_act": True}),
    # asymmetric GPTQ (a zero per group and output column): in order (int4 kernel), act-order (dequantized), 8-bit
    # one group (int8 kernel with its zero term), v2 zeros (0 included) with act-order
    ("llama", "gptq", {"symmetric": False}), ("qwen3_moe", "gptq", {"symmetric": False, "desc_act": True}),
    ("llama", "gptq", {"symmetric": False, "bits": 8, "group_size": -1}),
    ("llama", "gptq", {"symmetric": False, "gptq_format": "gptq_v2"}),
    ("qwen3_moe", "gptq", {"symmetric": False, "bits": 8, "desc_act": True, "gptq_format": "gptq_v2"}),
    ("llama", "awq", {}), ("qwen3_moe", "awq", {}),
]


def _options(quant: str, extra: dict) -> QuantOptions:
    return QuantOptions(**{"block": 16, **extra}) if quant == "fp8-block" else QuantOptions(**extra)


@pytest.mark.parametrize("arch,quant,extra", CASES, ids=lambda v: str(v))
def test_quantized_logits_and_greedy_match_transformers_on_the_dequantized_weights(checkpoint_factory, tmp_path,
                                                                                  arch, quant, extra):
    fused = {"fused_experts": True} if arch == "qwen3_5_moe_text" else {}  # as Qwen3.5's releases store them
    qpath = checkpoint_factory(arch, quant=quant, quant_options=_options(quant, extra), **fused)
    check_against(qpath, dequantized_folder(qpath, tmp_path / "ref"))


def test_mxfp4_fused_experts_match_transformers_dequantization(checkpoint_factory, tmp_path):
    qpath = checkpoint_factory("qwen3_moe", fused_experts=True, quant="mxfp4")
    check_against(qpath, dequantized_folder(qpath, tmp_path / "ref"))


@pytest.mark.parametrize("quant", ["fp8-block", "ct-int4", "ct-int8", "gptq", "awq", "mxfp4"])
def test_quantized_at_a_quarter_budget(checkpoint_factory, tmp_path, quant):
    """The store moves the quantized bytes through a 25% RAM budget (experts streamed): same logits and tokens."""
    qpath = checkpoint_factory("qwen3_moe", "offload", quant=quant, fused_experts=quant == "mxfp4",
                               quant_options=_options(quant, {}))
    check_against(qpath, dequantized_folder(qpath, tmp_path / "ref"), budgets=("25%",))


@pytest.mark.parametrize("quant", ["fp8-block", "ct-int4", "gptq", "mxfp4"])
def test_units_hold_the_quantized_bytes_as_stored(checkpoint_factory, quant):
    """The schema groups each weight with its scales in its unit: a unit's blob is the bytes on disk (plus alignment
    padding), a quarter to a half of the fp32 unit, and every tensor of the folder belongs to a unit."""
    from offload_engine.checkpoint.model import open_model

    fused = quant == "mxfp4"
    plain = open_model(checkpoint_factory("qwen3_moe", fused_experts=fused))
    ck = open_model(checkpoint_factory("qwen3_moe", fused_experts=fused, quant=quant,
                                       quant_options=_options(quant, {})))
    assert ck.formats and not ck.unused_tensors
    expert = next(k for k in ck.layouts if k.kind == "expert")
    stored = sum(s.nbytes for s in ck.layouts[expert].slices)
    assert stored <= ck.unit_bytes(expert) < stored + 64
    assert ck.unit_bytes(expert) < plain.unit_bytes(expert) / 2


def test_bf16_compute_runs_on_dequantized_scratch(checkpoint_factory):
    qpath = checkpoint_factory("qwen3_moe", quant="ct-int4", quant_options=_options("ct-int4", {}))
    with Engine.open(qpath, dtype="bfloat16") as engine:
        assert torch.isfinite(engine.logits([1, 2, 3, 4])).all()
