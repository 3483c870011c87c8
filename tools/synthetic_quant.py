#!/usr/bin/env python3
"""A random-weight checkpoint written straight into a quantized format, tensor by tensor, never whole in memory.

make_checkpoint.py builds a model in transformers, saves it and then quantizes the folder: right for test sizes,
impossible for a full-depth 30B-A3B shape on a machine whose disk (64 GiB) cannot hold the 61 GB bf16 copy first.
Here the tensor names and shapes come from transformers' own class built on the meta device (no memory), each
weight is drawn (on `--device`, e.g. cuda), quantized by tools/quant_writers.py's writers (the release's names and
config fields) and appended to a shard of at most `--shard-size` bytes.

  python tools/synthetic_quant.py --config configs/models/Qwen3-30B-A3B.json --quant ct-int4 --out /scratch/q30b-int4

The weights are noise (std 0.02, norms 1): for bytes, budgets and speed, not for text.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

try:
    from tools.quant_writers import QUANTS, QuantOptions, quant_config, quantizable, quantize_tensor
except ModuleNotFoundError:  # run as a script: tools/ is on sys.path, the repo root may not be
    from quant_writers import QUANTS, QuantOptions, quant_config, quantizable, quantize_tensor  # type: ignore

STD = 0.02
SLACK = 1 << 30  # free space kept beyond the checkpoint (the page cache's dirty pages, the index)


FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def tensor_shapes(config: dict, fused_experts: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor transformers' class for `config` holds, with its shape and dtype, built on the meta device.
    transformers 5 holds routed experts fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]);
    unless `fused_experts`, they are named per expert as Qwen3-MoE / DeepSeek releases store them."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    shapes = {}
    for name, t in model.state_dict().items():
        fused = FUSED.match(name)
        if fused is None or fused_experts:
            shapes[name] = (tuple(t.shape), t.dtype)
            continue
        prefix, which = fused.groups()
        for e in range(t.shape[0]):
            if which == "down_proj":
                shapes[f"{prefix}.{e}.down_proj.weight"] = (tuple(t.shape[1:]), t.dtype)
            else:
                half = (t.shape[1] // 2, t.shape[2])
                shapes[f"{prefix}.{e}.gate_proj.weight"] = (half, t.dtype)
                shapes[f"{prefix}.{e}.up_proj.weight"] = (half, t.dtype)
    return shapes


def draw(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str) -> torch.Tensor:
    if name.endswith("norm.weight"):  # layer norms, q/k norms, the final norm
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return (torch.randn(shape, generator=gen, device=device) * STD).to(dtype)


def realistic_tensors(config: dict) -> dict[str, torch.Tensor]:
    """tools/realistic_routing.py's embedding, head and routers for `config` (float32: a 151k vocabulary), by the
    names of transformers' class, so that a written checkpoint routes with a published-like locality."""
    try:
        from tools.realistic_routing import RoutingPreset, routing_weights
    except ModuleNotFoundError:
        from realistic_routing import RoutingPreset, routing_weights  # type: ignore
    layers = list(range(config["num_hidden_layers"]))
    experts = config.get("num_experts") or config.get("n_routed_experts")
    embed, head, routers, _ = routing_weights(config["vocab_size"], config["hidden_size"], experts, layers,
                                              RoutingPreset(), dtype=torch.float32)
    out = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    out.update({f"model.layers.{i}.mlp.gate.weight": r for i, r in routers.items()})
    return out


def expected_bytes(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], quant: str, opts: QuantOptions) -> int:
    """The bytes the checkpoint's tensors will take: each distinct shape quantized once (zeros: the parts' sizes do
    not depend on the values), so the free-disk check runs before anything is written."""
    per_kind: dict[tuple, int] = {}
    total = 0
    gen = torch.Generator().manual_seed(0)
    for name, (shape, dtype) in shapes.items():
        quantized = quantizable(name, torch.empty(shape, dtype=dtype, device="meta"))
        key = (shape, dtype, quantized)
        if key not in per_kind:
            t = torch.zeros(shape, dtype=dtype)
            parts = quantize_tensor(name, t, quant, opts, gen) if quantized else {name: t}
            per_kind[key] = sum(v.numel() * v.element_size() for v in parts.values())
        total += per_kind[key]
    return total


def check_disk(out: Path, need: int) -> None:
    """SystemExit naming what is needed and what is free, before writing `need` bytes under out's folder."""
    where = out.parent if out.parent.exists() else Path(".")
    free = shutil.disk_usage(where).free
    if need + SLACK > free:
        raise SystemExit(f"{out}: needs {need / 2**30:.2f} GiB (+{SLACK / 2**30:.0f} GiB slack) but {where} has "
                         f"{free / 2**30:.2f} GiB free")


def write_synthetic(config: dict, out: Path, quant: str, opts: QuantOptions = QuantOptions(),
                    device: str = "cpu", shard_bytes: int = 2 << 30, fused_experts: bool = False,
                    realistic: bool = False) -> dict:
    """Write the folder (config.json with its quantization_config, shards, index). Returns bytes and seconds.
    `realistic`: the embedding, head and routers of tools/realistic_routing.py instead of noise."""
    if quant not in QUANTS:
        raise SystemExit(f"--quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    shapes = tensor_shapes(config, fused_experts)
    check_disk(out, expected_bytes(shapes, quant, opts))
    tmp = out.with_name(out.name + ".partial")  # published by one rename: never a half-written folder at `out`
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator(device=device).manual_seed(opts.seed)
    chosen = realistic_tensors(config) if realistic else {}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total, started = 0, 0, time.perf_counter()
    names = []

    def flush() -> None:
        nonlocal size
        if shards[-1]:
            names.append(f"model-{len(names) + 1:05d}.safetensors")
            save_file(shards[-1], tmp / names[-1], metadata={"format": "pt"})
            shards[-1] = {}
        size = 0

    weight_map: dict[str, int] = {}
    for name, (shape, dtype) in tqdm(shapes.items(), desc=f"writing {quant}", unit="tensor"):
        t = chosen.pop(name).to(dtype) if name in chosen else draw(name, shape, dtype, gen, device)
        parts = quantize_tensor(name, t, quant, opts, gen) if quantizable(name, t) else {name: t}
        for part, value in parts.items():
            value = value.contiguous().cpu()
            nbytes = value.numel() * value.element_size()
            if size and size + nbytes > shard_bytes:
                flush()
            shards[-1][part] = value
            weight_map[part] = len(names)  # the shard it lands in: names grows by one per flush
            size += nbytes
            total += nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = {**config, "torch_dtype": "bfloat16", "quantization_config": quant_config(quant, opts)}
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if realistic:  # the marker tools/realistic_routing.py leaves: the settings applied
        from dataclasses import asdict

        try:
            from tools.realistic_routing import MARKER, RoutingPreset
        except ModuleNotFoundError:
            from realistic_routing import MARKER, RoutingPreset  # type: ignore
        (tmp / MARKER).write_text(json.dumps(asdict(RoutingPreset()), indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return {"bytes": total, "shards": len(names), "tensors": len(weight_map), "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, type=Path, help="a config.json (e.g. configs/models/*.json)")
    ap.add_argument("--quant", required=True, choices=QUANTS)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers instead of the config's")
    ap.add_argument("--device", default="cpu", help="where weights are drawn and quantized (cuda is far faster)")
    ap.add_argument("--shard-size", type=int, default=2 << 30, help="bytes per shard (default 2 GiB)")
    ap.add_argument("--group", type=int, default=32, help="int4 group size (default 32)")
    ap.add_argument("--fused-experts", action="store_true",
                    help="store routed experts fused (Qwen3.5-MoE / gpt-oss releases) instead of per expert")
    ap.add_argument("--routing", default="random", choices=("random", "realistic"),
                    help="realistic: tools/realistic_routing.py's embedding, head and routers (MoE configs)")
    args = ap.parse_args(argv)
    config = json.loads(args.config.read_text())
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    result = write_synthetic(config, args.out, args.quant, QuantOptions(group_size=args.group), args.device,
                             args.shard_size, args.fused_experts, args.routing == "realistic")
    print(f"wrote {args.out}: {result['bytes'] / 2**30:.2f} GiB in {result['shards']} shards, "
          f"{result['tensors']} tensors, {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
