"""`offload-engine inspect`: its parser, and what it says about an opened checkpoint: shape, parameters, the
weight format (method, bits, group), bits per weight and the bytes of each kind of unit as the store moves them
(checkpoint/layout.py's blobs), so they can be set beside `plan`'s (planner/formats.py sizes the same units from
config.json)."""
from __future__ import annotations

import argparse
from typing import Any

from ..checkpoint.formats import MARK, PRIMARY, decode, format_summary
from ..checkpoint.model import ModelCheckpoint
from ..checkpoint.naming import ModelSchema, TensorSpec, UnitKey
from ..planner.quant_sizes import describe
from ..planner.sizes import param_counts
from ..units import format_bytes
from .common import add_common, add_model_arguments, subcommand

KIND_ORDER = ("embed", "dense", "expert", "head", "mtp")
INSPECT_EXAMPLES = """examples:
  offload-engine inspect ~/models/Qwen3-30B-A3B
  offload-engine inspect --model DIR --json
"""


def add_inspect_parser(sub: Any) -> argparse.ArgumentParser:
    ins = subcommand(sub, "inspect", "describe a checkpoint without loading it", INSPECT_EXAMPLES)
    add_model_arguments(ins, "Hugging Face folder or a .gguf file")
    ins.add_argument("--json", action="store_true")
    add_common(ins)
    ins.set_defaults(func=cmd_inspect)
    return ins


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from ..checkpoint.model import open_model
    from ..runtime.mtp import attach_mtp_units

    ck = attach_mtp_units(open_model(args.model))  # MTP layers counted as such, not listed as unused tensors
    report = inspect_report(ck)
    print(json.dumps(report, indent=2) if args.json else inspect_text(report))
    return 0


def weight_params(local: str, spec: TensorSpec) -> int:
    """Parameters a unit tensor stands for: a quantized weight's data counts its logical [out, in] weights, its
    scales, zeros and shape none; a plain tensor its elements."""
    if PRIMARY in local:
        q = decode(local.split(PRIMARY, 1)[1])
        return q.out * q.inp
    return 0 if MARK in local else spec.numel


def logical_schema(schema: ModelSchema) -> ModelSchema:
    """The schema with each quantized weight's components back to the one [out, in] weight they store (what
    parameter counts count)."""
    units = {}
    for key, specs in schema.units.items():
        out = {}
        for local, spec in specs.items():
            if PRIMARY in local:
                q = decode(local.split(PRIMARY, 1)[1])
                out[local.split(PRIMARY, 1)[0]] = TensorSpec(spec.hf_name, (q.out, q.inp), index=spec.index)
            elif MARK not in local:
                out[local] = spec
        units[key] = out
    return ModelSchema(units)


def kind_of(key: UnitKey, mtp_layers: set[int]) -> str:
    """The unit's kind, with every unit of an MTP layer (its experts too) counted as "mtp" (as sizes.param_counts)."""
    return "mtp" if key.layer in mtp_layers and key.kind != "head" else key.kind


def units_by_kind(ck: ModelCheckpoint) -> dict[str, dict[str, Any]]:
    """Per kind: units, bytes, the largest unit (a slot's size), parameters and bits per weight."""
    mtp_layers = {k.layer for k in ck.layouts if k.kind == "mtp"}
    out: dict[str, dict[str, Any]] = {}
    for key, layout in ck.layouts.items():
        params = sum(weight_params(local, spec) for local, spec in ck.schema.units[key].items())
        row = out.setdefault(kind_of(key, mtp_layers), {"units": 0, "bytes": 0, "unit_bytes": 0, "params": 0})
        row.update(units=row["units"] + 1, bytes=row["bytes"] + layout.nbytes,
                   unit_bytes=max(row["unit_bytes"], layout.nbytes), params=row["params"] + params)
    for row in out.values():
        row["bits_per_weight"] = round(8 * row["bytes"] / row["params"], 3) if row["params"] else None
    return {k: out[k] for k in sorted(out, key=lambda k: KIND_ORDER.index(k) if k in KIND_ORDER else 9)}


def weight_format(ck: ModelCheckpoint) -> dict[str, Any]:
    """The checkpoint's format: its quantization method as config.json names it, what the headers hold (bits,
    groups, blocks) and how many weights are quantized."""
    if ck.quant is None and str(ck.root).endswith(".gguf"):  # GGUF: each tensor has its own type
        types = sorted({r.dtype if r.dtype != "U8" else "block" for r in ck.index.tensors.values()}
                       | {q.gtype for q in ck.formats.values()} - {"block"})
        return {"quant_method": "gguf", "description": f"GGUF ({', '.join(t for t in types if t != 'block')})",
                "bits": [], "group_sizes": [], "blocks": [], "quantized_weights": len(ck.formats),
                "summary": format_summary(ck.formats)}
    if ck.quant is None:
        return {"quant_method": None, "description": f"{ck.spec.dtype} (not quantized)", "bits": [],
                "group_sizes": [], "blocks": [], "quantized_weights": 0}
    specs = list(ck.formats.values())
    return {"quant_method": ck.quant.method, "description": describe(ck.quant),
            "bits": sorted({q.bits for q in specs}),
            "group_sizes": sorted({q.group for q in specs if q.group}),
            "blocks": [list(b) for b in sorted({q.block for q in specs if any(q.block)})],
            "strategies": sorted({q.strategy for q in specs}),
            "quantized_weights": len(specs), "summary": format_summary(ck.formats)}


def inspect_report(ck: ModelCheckpoint) -> dict[str, Any]:
    counts = param_counts(logical_schema(ck.schema), ck.spec.num_experts_per_tok)
    kinds = units_by_kind(ck)
    params = sum(r["params"] for r in kinds.values())
    return {
        "path": str(ck.root),
        "model_type": ck.spec.model_type,
        "architectures": ck.spec.get("architectures"),
        "dtype": ck.spec.dtype,
        "layers": ck.spec.num_layers,
        "experts": ck.spec.num_experts,
        "experts_per_token": ck.spec.num_experts_per_tok,
        "fused_experts": ck.fused_experts,
        "params_total": counts.total,
        "params_active": counts.active,
        "params_mtp": counts.mtp,
        "format": weight_format(ck),
        "bits_per_weight": round(8 * ck.total_bytes / params, 3) if params else None,
        "bytes_total": ck.total_bytes,
        "bytes_by_kind": ck.bytes_by_kind(),
        "units_by_kind": {k: sum(1 for key in ck.layouts if key.kind == k) for k in ck.bytes_by_kind()},
        "units": kinds,
        "shards": [{"file": s.path.name, "bytes": s.size, "tensors": sum(1 for r in ck.index.tensors.values()
                                                                          if r.file == s.path)}
                   for s in ck.index.shards],
        "unused_tensors": ck.unused_tensors,
    }


def inspect_text(r: dict[str, Any]) -> str:
    fmt = r["format"]
    lines = [f"{r['path']}: {r['model_type']} ({', '.join(r['architectures'] or [])}), {r['dtype']}",
             f"  layers {r['layers']}, experts {r['experts']} (top-{r['experts_per_token']})"
             f"{', fused expert tensors' if r['fused_experts'] else ''}",
             f"  parameters: {_count(r['params_total'])} total, {_count(r['params_active'])} active per token"
             + (f", {_count(r['params_mtp'])} MTP" if r["params_mtp"] else ""),
             f"  format: {fmt['description']}"
             + (f"; {fmt['summary']}" if fmt.get("summary") else ""),
             f"  bytes: {format_bytes(r['bytes_total'])}, {r['bits_per_weight']} bits per weight",
             f"    {'kind':<7} {'units':>6} {'bytes':>12} {'share':>6} {'unit bytes':>12} {'bits/weight':>11}"]
    for kind, k in r["units"].items():
        bits = "-" if k["bits_per_weight"] is None else f"{k['bits_per_weight']:.3f}"
        lines.append(f"    {kind:<7} {k['units']:>6} {format_bytes(k['bytes']):>12} "
                     f"{100 * k['bytes'] / r['bytes_total']:5.1f}% {format_bytes(k['unit_bytes']):>12} {bits:>11}")
    lines.append(f"  shards ({len(r['shards'])}):")
    lines += [f"    {s['file']}  {format_bytes(s['bytes'])}  {s['tensors']} tensors" for s in r["shards"]]
    unused = r["unused_tensors"]
    if unused:
        lines.append(f"  unused tensors ({len(unused)}): {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}")
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"
