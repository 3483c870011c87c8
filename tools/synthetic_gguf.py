#!/usr/bin/env python3
"""A random-weight GGUF of a real model's shape, streamed tensor by tensor: the file llama.cpp's users have.

tools/synthetic_quant.py writes the engine's own formats (safetensors); this writes the same shape as a GGUF that
llama.cpp and the engine both read, so that both run on the same bytes. The `gguf` package's GGUFWriter takes every
tensor's header first and then the data one tensor at a time: memory holds one tensor (an expert stack of a
30B-A3B layer is ~113 MB at Q4_0), never the model. Weight matrices are random valid blocks of `--type` (Q4_0 or
Q8_0: an f16 scale giving weights of std ~0.02, the integer part uniform); norms are ones; the routers are F32 (as
llama.cpp's converter keeps them). With `--routing realistic` (the default) the embedding, the head and the routers
come from tools/realistic_routing.py, so routing has a published-like locality; they are quantized by the `gguf`
package itself. The tokenizer is the bundled demo model's byte-level BPE, padded with unused tokens to the config's
vocabulary.

    python tools/synthetic_gguf.py --config configs/models/Qwen3-30B-A3B.json --type Q4_0 --out /work/big/q30b-Q4_0.gguf

Before writing, the exact file size is compared with the free space of the target's disk; the file is written as
OUT.part and renamed when complete. Supports qwen3_moe configs (Qwen3-30B-A3B, Qwen3-235B-A22B and their kin).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.gguf_from_hf import _metadata  # noqa: E402
from tools.realistic_routing import RoutingPreset, routing_weights  # noqa: E402

DEMO = ROOT / "offload_engine" / "data" / "demo-model"
TYPES = ("Q4_0", "Q8_0")
STD = 0.02
# the std of each random-block type's integer part: its f16 scale d = STD / that std
BLOCK_INT_STD = {"Q4_0": 4.61, "Q8_0": 73.9}  # uniform 0..15 minus 8; uniform -128..127
SLACK = 1 << 30  # free space kept beyond the file: the page cache's dirty pages, the .part rename


@dataclass(frozen=True)
class TensorSpec:
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order (rows last-but-one, the contiguous dimension last)
    kind: str  # "F32" or a block type
    source: str  # "ones", "random", or a key of the realistic tensors ("embed", "head", "router:<layer>")


def plan_tensors(cfg: dict, gtype: str, realistic: bool) -> list[TensorSpec]:
    """Every tensor llama.cpp's qwen3moe graph loads, in the converter's order."""
    import gguf

    if cfg.get("model_type") != "qwen3_moe":
        raise SystemExit(f"model_type {cfg.get('model_type')!r}: this writer supports qwen3_moe configs")
    t, n = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    hidden, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim", 128)
    experts, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    for what, width in (("hidden_size", hidden), ("moe_intermediate_size", inter), ("head_dim", heads * head_dim)):
        if width % 32:
            raise SystemExit(f"{what} {width} is not a multiple of 32: {gtype} blocks need whole rows")
    specs = [TensorSpec(n[t.TOKEN_EMBD] + ".weight", (vocab, hidden), gtype, "embed" if realistic else "random")]
    for i in range(layers):
        blk = {k: n[k].format(bid=i) + ".weight" for k in (
            t.ATTN_NORM, t.ATTN_Q, t.ATTN_K, t.ATTN_V, t.ATTN_OUT, t.ATTN_Q_NORM, t.ATTN_K_NORM, t.FFN_NORM,
            t.FFN_GATE_INP, t.FFN_GATE_EXP, t.FFN_UP_EXP, t.FFN_DOWN_EXP)}
        specs += [
            TensorSpec(blk[t.ATTN_NORM], (hidden,), "F32", "ones"),
            TensorSpec(blk[t.ATTN_Q], (heads * head_dim, hidden), gtype, "random"),
            TensorSpec(blk[t.ATTN_K], (kv * head_dim, hidden), gtype, "random"),
            TensorSpec(blk[t.ATTN_V], (kv * head_dim, hidden), gtype, "random"),
            TensorSpec(blk[t.ATTN_OUT], (hidden, heads * head_dim), gtype, "random"),
            TensorSpec(blk[t.ATTN_Q_NORM], (head_dim,), "F32", "ones"),
            TensorSpec(blk[t.ATTN_K_NORM], (head_dim,), "F32", "ones"),
            TensorSpec(blk[t.FFN_NORM], (hidden,), "F32", "ones"),
            TensorSpec(blk[t.FFN_GATE_INP], (experts, hidden), "F32", f"router:{i}" if realistic else "random"),
            TensorSpec(blk[t.FFN_GATE_EXP], (experts, inter, hidden), gtype, "random"),
            TensorSpec(blk[t.FFN_UP_EXP], (experts, inter, hidden), gtype, "random"),
            TensorSpec(blk[t.FFN_DOWN_EXP], (experts, hidden, inter), gtype, "random"),
        ]
    specs += [TensorSpec(n[t.OUTPUT_NORM] + ".weight", (hidden,), "F32", "ones"),
              TensorSpec(n[t.OUTPUT] + ".weight", (vocab, hidden), gtype, "head" if realistic else "random")]
    return specs


def tensor_bytes(spec: TensorSpec) -> int:
    import gguf

    if spec.kind == "F32":
        return 4 * int(np.prod(spec.shape))
    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[spec.kind]]
    return int(np.prod(spec.shape[:-1])) * spec.shape[-1] // per * size


def file_bytes(specs: list[TensorSpec], alignment: int = 32) -> int:
    """The tensor data's size with GGUF's alignment padding (the header adds a few MB at most: the vocabulary)."""
    return sum(-(-tensor_bytes(s) // alignment) * alignment for s in specs)


def random_blocks(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks: uniform integer parts, each block's f16 scale d = STD / std(int) x U(0.75, 1.25)."""
    import gguf

    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[spec.kind]]
    n_blocks = int(np.prod(spec.shape)) // per
    blocks = np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()
    d = (STD / BLOCK_INT_STD[spec.kind]) * rng.uniform(0.75, 1.25, size=n_blocks).astype(np.float32)
    blocks[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*spec.shape[:-1], spec.shape[-1] // per * size)


def _tokenizer(w, vocab_size: int, folder: Path = DEMO) -> None:
    """The demo model's byte-level BPE, padded with unused tokens to `vocab_size` entries."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab.update(special)
    if max(vocab.values()) >= vocab_size:
        raise SystemExit(f"the demo tokenizer has {max(vocab.values()) + 1} tokens, more than vocab_size {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for text, i in vocab.items():
        tokens[i] = text
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name for GPT-2's regex ("gpt2" is refused as unknown)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else (5 if t.startswith("[PAD") else 1) for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(special[tcfg["bos_token"]])
    w.add_eos_token_id(special[tcfg["eos_token"]])
    w.add_add_bos_token(False)


def realistic_sources(cfg: dict, preset: RoutingPreset) -> dict[str, np.ndarray]:
    """The embedding, head and routers of tools/realistic_routing.py, in float32 (half the float64 peak)."""
    import torch

    layers = list(range(cfg["num_hidden_layers"]))
    embed, head, routers, _ = routing_weights(cfg["vocab_size"], cfg["hidden_size"], cfg["num_experts"], layers,
                                              preset, dtype=torch.float32)
    out = {"embed": embed.numpy(), "head": head.numpy()}
    out.update({f"router:{i}": r.numpy() for i, r in routers.items()})
    return out


def tensor_data(specs: list[TensorSpec], sources: dict[str, np.ndarray], seed: int) -> Iterator[np.ndarray]:
    import gguf

    rng = np.random.default_rng(seed)
    for s in specs:
        if s.source == "ones":
            yield np.ones(s.shape, dtype=np.float32)
        elif s.source == "random" and s.kind == "F32":
            yield (rng.standard_normal(s.shape, dtype=np.float32) * STD)
        elif s.source == "random":
            yield random_blocks(s, rng)
        elif s.kind == "F32":
            yield np.ascontiguousarray(sources.pop(s.source), dtype=np.float32)
        else:  # the realistic embedding / head, quantized by the gguf package itself
            yield gguf.quants.quantize(sources.pop(s.source), gguf.GGMLQuantizationType[s.kind])


def check_disk(out: Path, need: int) -> None:
    free = shutil.disk_usage(out.parent).free
    if need + SLACK > free:
        raise SystemExit(f"{out}: needs {need / 2**30:.2f} GiB (+{SLACK / 2**30:.0f} GiB slack) but "
                         f"{out.parent} has {free / 2**30:.2f} GiB free")


def write_synthetic_gguf(cfg: dict, out: Path, gtype: str = "Q4_0", realistic: bool = True, seed: int = 0,
                         preset: RoutingPreset = RoutingPreset(),
                         progress: Callable[[int, int], None] | None = None) -> dict:
    """Write `out` (via OUT.part). Returns bytes, tensors and seconds."""
    import gguf

    if gtype not in TYPES:
        raise SystemExit(f"--type must be one of {', '.join(TYPES)}, not {gtype!r}")
    specs = plan_tensors(cfg, gtype, realistic)
    need = file_bytes(specs)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_disk(out, need)
    started = time.perf_counter()
    part = out.with_name(out.name + ".part")
    try:
        w = gguf.GGUFWriter(part, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE])
        _metadata(w, cfg, set())
        w.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gtype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _tokenizer(w, cfg["vocab_size"])
        for s in specs:
            qt = gguf.GGMLQuantizationType[s.kind]
            byte_shape = s.shape if s.kind == "F32" else (*s.shape[:-1], tensor_bytes(s) // int(np.prod(s.shape[:-1])))
            w.add_tensor_info(s.name, byte_shape, np.dtype(np.float32 if s.kind == "F32" else np.uint8),
                              tensor_bytes(s), raw_dtype=None if s.kind == "F32" else qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        sources = realistic_sources(cfg, preset) if realistic else {}
        done = 0
        for data in tensor_data(specs, sources, seed):
            w.write_tensor_data(data)
            done += data.nbytes
            if progress:
                progress(done, need)
        w.close()
        os.replace(part, out)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return {"bytes": out.stat().st_size, "tensors": len(specs), "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, type=Path, help="a qwen3_moe config.json (configs/models/*.json)")
    ap.add_argument("--type", default="Q4_0", choices=TYPES)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers instead of the config's")
    ap.add_argument("--experts", type=int, default=None, help="num_experts instead of the config's (CI sizes)")
    ap.add_argument("--vocab", type=int, default=None, help="vocab_size instead of the config's (CI sizes)")
    ap.add_argument("--routing", default="realistic", choices=("realistic", "random"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = json.loads(args.config.read_text())
    for key, value in (("num_hidden_layers", args.layers), ("num_experts", args.experts), ("vocab_size", args.vocab)):
        if value is not None:
            cfg[key] = value
    cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], cfg["num_experts"])
    from tqdm import tqdm

    bar = tqdm(total=file_bytes(plan_tensors(cfg, args.type, args.routing == "realistic")), unit="B",
               unit_scale=True, desc=f"writing {args.out.name}")
    result = write_synthetic_gguf(cfg, args.out, args.type, args.routing == "realistic", args.seed,
                                  progress=lambda done, _: bar.update(done - bar.n))
    bar.close()
    print(f"wrote {args.out}: {result['bytes'] / 2**30:.2f} GiB, {result['tensors']} tensors, "
          f"{result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
