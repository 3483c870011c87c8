"""Quantized copies of a checkpoint folder, in the released formats' exact tensor names and config fields.

`quantize_folder(folder, quant)` rewrites the folder's shards in place (each weight's scales in its shard) and adds
config.json's `quantization_config`. MTP layers are quantized like the trunk, as the releases do.

  fp8-block  DeepSeek-V3 / Kimi K2: float8_e4m3fn `*.weight` + float32 `*.weight_scale_inv` per block (W = q * s)
  ct-int4    compressed-tensors pack-quantized int4 group (Kimi K2 Thinking), by `offload-engine quantize`'s own
             writer (offload_engine/quantize/scheme.py, equal to the library's compressor: tests/test_quantize.py);
             asymmetric (QuantOptions(symmetric=False)) by the library's compressor; a weight whose in_features
             the group does not divide is kept and named in `ignore`
  ct-int8    compressed-tensors pack-quantized int8 channel (llm-compressor's W8A16), likewise; with
             QuantOptions(ct_format="int-quantized") the int8 values unpacked (W8A8's format, the library's)
  ct-fp8     compressed-tensors float-quantized fp8, channel (FP8_DYNAMIC) or block (FP8_BLOCK) strategy
  gptq       qweight / qzeros / scales / g_idx, 4 or 8 bits, optional act-order; symmetric (zero 2^(bits-1), as
             AutoGPTQ's sym=True) or asymmetric (QuantOptions(symmetric=False): AutoGPTQ's min/max quantizer, a
             zero per group and output column); zeros stored minus one (checkpoint_format "gptq", v1: a zero of 0
             cannot be stored there, AutoGPTQ's packer writes its -1 over the neighbouring fields, so v1 zeros are
             kept >= 1) or as they are (QuantOptions(gptq_format="gptq_v2"), gptqmodel's v2)
  awq        AWQ GEMM: qweight [in, out/8] in nibble order 0,2,4,6,1,3,5,7, qzeros (a zero per group and output
             column, AutoAWQ's zero-point quantizer), scales
  mxfp4      gpt-oss: fused experts only, `*_blocks` [E, rows, cols/32, 16] + e8m0 `*_scales` [E, rows, cols/32]

Quantized: every linear weight of the decoder (and MTP) layers; kept: embeddings, lm_head, norms, routers
(`mlp.gate`), DeepSeek's `e_score_correction_bias`, and the MTP layers' copies of the embedding and head.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from offload_engine.quantize.scheme import WeightScheme, quantize_rows, shape_tensor, stored_tensors

QUANTS = ("fp8-block", "ct-int4", "ct-int8", "ct-fp8", "gptq", "awq", "mxfp4")
_KEEP = re.compile(r"(embed_tokens|lm_head|shared_head\.head|norm|mlp\.gate$|shared_expert_gate$|visual\.)")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8k + AWQ_ORDER[i]
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@dataclass(frozen=True)
class QuantOptions:
    block: int = 128  # fp8-block weight_block_size (both dims)
    group_size: int = 32  # ct-int4 / gptq / awq group (gptq: -1 for one group)
    symmetric: bool = True  # ct-int4 / ct-int8 / gptq
    strategy: str | None = None  # ct: "group" (int4 default), "channel" (int8 / fp8 default), "block" (fp8)
    ct_format: str = "pack-quantized"  # ct-int4 / ct-int8: or "int-quantized" (int8 values, one per byte)
    bits: int = 4  # gptq
    gptq_format: str = "gptq"  # gptq checkpoint_format: "gptq" (v1, zeros stored minus one) or "gptq_v2"
    desc_act: bool = False  # gptq act-order: a random permutation of the groups (g_idx)
    seed: int = 0
    input_major_experts: bool = False  # fused experts stored [E, in, out] (gpt-oss in bf16): mxfp4 blocks the input


def quantizable(name: str, t: torch.Tensor, quant: str | None = None, opts: QuantOptions = QuantOptions()) -> bool:
    if _FUSED.search(name):
        return t.dim() == 3 and not ungrouped(t, quant, opts)
    return (name.endswith(".weight") and t.dim() == 2 and not _KEEP.search(name.removesuffix(".weight"))
            and not ungrouped(t, quant, opts))


def ungrouped(t: torch.Tensor, quant: str | None, opts: QuantOptions) -> bool:
    """A compressed-tensors group-strategy weight whose in_features the group does not divide (the demo's
    kv_b_proj has 48): kept as stored, and its module named in the config's `ignore` (quantize_folder)."""
    if quant not in ("ct-int4", "ct-int8") or t.dim() < 2:
        return False
    strategy = opts.strategy or ("group" if quant == "ct-int4" else "channel")
    return strategy == "group" and t.shape[-1] % opts.group_size != 0


def quantize_folder(folder: Path, quant: str, opts: QuantOptions = QuantOptions()) -> list[str]:
    """Returns the modules kept because the group does not divide their in_features (see `ungrouped`)."""
    if quant not in QUANTS:
        raise ValueError(f"--quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    gen = torch.Generator().manual_seed(opts.seed)
    if json.loads((folder / "config.json").read_text()).get("model_type") == "gpt_oss":
        opts = dataclasses.replace(opts, input_major_experts=True)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    weight_map = {}
    kept = []
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if ungrouped(t, quant, opts) and quantizable(name, t):
                kept.append(name.removesuffix(".weight"))
            parts = quantize_tensor(name, t, quant, opts, gen) if quantizable(name, t, quant, opts) else None
            out.update(parts if parts is not None else {name: t})
        save_file({k: v.contiguous() for k, v in out.items()}, shard, metadata={"format": "pt"})
        weight_map.update({k: shard.name for k in out})
    if index is not None:
        index["weight_map"] = dict(sorted(weight_map.items()))
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quant_config(quant, opts, tuple(sorted(kept)))
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return sorted(kept)


def quant_config(quant: str, opts: QuantOptions, kept: tuple[str, ...] = ()) -> dict:
    if quant == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [opts.block, opts.block]}
    if quant.startswith("ct-"):
        from compressed_tensors.quantization import QuantizationConfig

        ignore = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", *kept]
        fmt = "float-quantized" if quant == "ct-fp8" else opts.ct_format
        config = QuantizationConfig(config_groups={"group_0": ct_scheme(quant, opts)}, format=fmt,
                                    quantization_status="compressed", ignore=ignore)
        return config.model_dump(mode="json")
    if quant == "gptq":
        # both names of the format field, as transformers 5's GPTQConfig.to_dict and gptqmodel write them
        return {"bits": opts.bits, "checkpoint_format": opts.gptq_format, "damp_percent": 0.01,
                "desc_act": opts.desc_act, "format": opts.gptq_format, "group_size": opts.group_size,
                "quant_method": "gptq", "sym": opts.symmetric, "true_sequential": True}
    if quant == "awq":
        return {"bits": 4, "group_size": opts.group_size, "modules_to_not_convert": None, "quant_method": "awq",
                "version": "gemm", "zero_point": True}
    return {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def ct_scheme(quant: str, opts: QuantOptions):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    bits = 4 if quant == "ct-int4" else 8
    strategy = opts.strategy or ("group" if bits == 4 else "channel")
    if quant == "ct-fp8":
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                                block_structure=[opts.block, opts.block] if strategy == "block" else None)
    else:
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=opts.symmetric, strategy=strategy,
                                group_size=opts.group_size if strategy == "group" else None)
    return QuantizationScheme(targets=["Linear"], weights=args)


def quantize_tensor(name: str, t: torch.Tensor, quant: str, opts: QuantOptions, gen: torch.Generator):
    """One quantizable tensor -> its stored components under the release's names (None: the format keeps it)."""
    fused = _FUSED.search(name) is not None
    if quant == "mxfp4":
        return _mxfp4(name, t.transpose(1, 2) if opts.input_major_experts else t) if fused else None
    if fused:  # one expert at a time, stacked back: [E, ...] components
        per = [_quantize_2d(name, t[e], quant, opts, gen) for e in range(t.shape[0])]
        return {k: torch.stack([p[k] for p in per]) for k in per[0]}
    return _quantize_2d(name, t, quant, opts, gen)


def _quantize_2d(name: str, w: torch.Tensor, quant: str, opts: QuantOptions, gen: torch.Generator) -> dict:
    w = w.float()
    if quant == "fp8-block":
        return _fp8_block(name, w, opts.block)
    if quant.startswith("ct-"):
        return _compressed_tensors(name, w, quant, opts)
    module = name.removesuffix(".weight")
    if quant == "gptq":
        return _gptq(module, w, opts, gen)
    return _awq(module, w, opts.group_size)


def _fp8_block(name: str, w: torch.Tensor, b: int) -> dict:
    out, inp = w.shape
    rows, cols = -(-out // b), -(-inp // b)
    padded = torch.zeros(rows * b, cols * b)
    padded[:out, :inp] = w
    blocks = padded.view(rows, b, cols, b)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # float8_e4m3fn's largest finite value
    q = (blocks / scale[:, None, :, None]).view(rows * b, cols * b)[:out, :inp].to(torch.float8_e4m3fn)
    return {name: q, name + "_scale_inv": scale.float()}


def _compressed_tensors(name: str, w: torch.Tensor, quant: str, opts: QuantOptions) -> dict:
    """Symmetric pack-quantized and float-quantized weights: the product's own writer (offload_engine/quantize,
    checked against the library's compressors in tests/test_quantize.py), bf16 scales as the releases store them.
    Asymmetric and int-quantized ones: scales from the weight's range, then the library's own compressor
    quantizes and packs (and the zeros)."""
    from compressed_tensors.compressors import (FloatQuantizationCompressor, IntQuantizationCompressor,
                                                PackedQuantizationCompressor)

    scheme = ct_scheme(quant, opts)
    a = scheme.weights
    if a.symmetric and (a.type == "float" or opts.ct_format == "pack-quantized"):
        ws = WeightScheme(a.type, a.num_bits, a.strategy, group=a.group_size or 0, block=opts.block)
        values, scale = quantize_rows(w, ws, torch.bfloat16)
        parts = stored_tensors(name, tuple(w.shape), ws, torch.bfloat16)
        return dict(zip((n for n, _, _ in parts), (values, scale, shape_tensor(tuple(w.shape)))))
    if a.type == "float":
        qmax, qmin = 448.0, -448.0  # float8_e4m3fn's range
    else:
        qmax, qmin = (1 << (a.num_bits - 1)) - 1, -(1 << (a.num_bits - 1))
    if a.strategy == "block":
        b = opts.block
        rows, cols = -(-w.shape[0] // b), -(-w.shape[1] // b)
        padded = torch.zeros(rows * b, cols * b)
        padded[:w.shape[0], :w.shape[1]] = w
        groups = padded.view(rows, b, cols, b).transpose(1, 2).reshape(rows, cols, b * b)
    else:
        groups = w.view(w.shape[0], -1, a.group_size) if a.strategy == "group" else w.view(w.shape[0], 1, -1)
    if a.symmetric:
        scale, zero = groups.abs().amax(-1).clamp(min=1e-8) / qmax, None
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((hi - lo) / (qmax - qmin)).clamp(min=1e-8)
        zero = (qmin - torch.round(lo / scale)).clamp(qmin, qmax).to(torch.int8)
    scale = scale.to(torch.bfloat16).float()  # the releases store bf16 scales; quantize with the stored value
    state = {"weight": w, "weight_scale": scale}
    if zero is not None:
        state["weight_zero_point"] = zero
    compressor = {"float": FloatQuantizationCompressor, "int-quantized": IntQuantizationCompressor}.get(
        a.type if a.type == "float" else opts.ct_format, PackedQuantizationCompressor)
    packed = compressor.compress(state, scheme)
    packed["weight_scale"] = packed["weight_scale"].to(torch.bfloat16)
    return {name + k.removeprefix("weight"): v for k, v in packed.items()}  # x.weight_packed / fused x_packed


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _pack_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[rows, cols] unsigned fields -> int32 [rows, cols * bits / 32]; field i of word k holds column
    k * per + order[i] (order: identity unless given)."""
    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0], -1, per)
    if order is not None:
        v = v[:, :, list(order)]
    shifts = torch.arange(per) * bits
    return _to_int32((v << shifts).sum(-1))


def _gptq(module: str, w: torch.Tensor, opts: QuantOptions, gen: torch.Generator) -> dict:
    out, inp = w.shape
    bits, maxq = opts.bits, (1 << opts.bits) - 1
    group = inp if opts.group_size == -1 else opts.group_size
    order = torch.randperm(inp, generator=gen) if opts.desc_act else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[order] = (torch.arange(inp) // group).to(torch.int32)  # act-order: groups follow the permuted columns
    if opts.gptq_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq_format must be 'gptq' or 'gptq_v2', not {opts.gptq_format!r}")
    v1 = opts.gptq_format == "gptq"
    groups = inp // group
    scales = torch.empty(groups, out)
    zeros = torch.empty(groups, out, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if opts.symmetric:  # zero at the middle of the range
            scales[g] = cols.abs().amax(1).clamp(min=1e-8) / (maxq // 2)
            zeros[g] = (maxq + 1) // 2
        else:  # AutoGPTQ's Quantizer(sym=False): [min(w, 0), max(w, 0)] in maxq steps, zero = round(-min / s)
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[g] = ((hi - lo) / maxq).clamp(min=1e-8)
            zeros[g] = torch.round(-lo / scales[g]).clamp(1 if v1 else 0, maxq).to(torch.int64)
    scales = scales.half()  # stored fp16: quantize with the stored value
    gi = g_idx.long()
    q = torch.clamp(torch.round(w.t() / scales.float()[gi]) + zeros[gi], 0, maxq).to(torch.int64)  # [in, out]
    stored_zeros = zeros - 1 if v1 else zeros  # GPTQ v1 stores zero - 1
    return {module + ".qweight": _to_int32(_pack_rows_i64(q, bits)),
            module + ".qzeros": _pack_cols(stored_zeros, bits), module + ".scales": scales, module + ".g_idx": g_idx}


def _pack_rows_i64(values: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    v = values.view(-1, per, values.shape[1])
    return (v << (torch.arange(per) * bits).view(1, per, 1)).sum(1)


def _awq(module: str, w: torch.Tensor, group: int) -> dict:
    out, inp = w.shape
    wt = w.t().reshape(inp // group, group, out)  # [groups, group, out]
    lo, hi = wt.amin(1).clamp(max=0), wt.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = torch.clamp(torch.round(-lo / scales), 0, 15)
    q = torch.clamp(torch.round(wt / scales[:, None]) + zeros[:, None], 0, 15).reshape(inp, out)
    return {module + ".qweight": _pack_cols(q, 4, AWQ_ORDER), module + ".qzeros": _pack_cols(zeros, 4, AWQ_ORDER),
            module + ".scales": scales.half()}


def _mxfp4(name: str, t: torch.Tensor) -> dict:
    """[E, rows, cols] -> blocks [E, rows, cols/32, 16] (low nibble first) and e8m0 scales [E, rows, cols/32]."""
    E, rows, cols = t.shape
    g = t.float().view(E, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-126) / 6.0)).clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp)[..., None]
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(-1).to(torch.uint8)  # nearest e2m1 value
    pairs = codes.view(E, rows, cols // 32, 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return {name + "_blocks": blocks, name + "_scales": (exp + 127).to(torch.uint8)}
