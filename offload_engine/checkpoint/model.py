"""open_model: index + config + architecture, validated together before anything is loaded."""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Iterable

from ..errors import CheckpointFormatError
from .arch import get_naming
from .formats import WeightFormats, quantize_schema
from .hf_config import ModelSpec, parse_config
from .index import FLOAT_DTYPES, TORCH_DTYPE_NAMES, CheckpointIndex
from .gguf.reader import is_gguf
from .layout import build_layout
from .naming import ModelSchema
from .opened import ModelCheckpoint
from .stage import Stage
from .quant_config import parse_quant_config

# fused experts, plain or stored quantized (MXFP4 `_blocks`, compressed-tensors `_packed`)
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_blocks|_packed)?$")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fused_expert_layout(names: Iterable[str], num_layers: int) -> bool:
    """Whether the decoder layers store their routed experts fused (transformers 5's `experts.gate_up_proj
    [E, 2I, H]`) rather than one tensor set per expert. Only the decoder's own layers decide: MTP layers (numbered
    after them, or under `mtp.`) may be written in the other layout, and runtime/mtp.py reads either."""
    for name in names:
        layer = _LAYER_INDEX.search(name)
        if (_FUSED_EXPERTS.search(name) and layer is not None and not name.startswith("mtp.")
                and int(layer.group(1)) < num_layers):
            return True
    return False


def open_model(path: str | os.PathLike, *, allow_cast: bool = False, stage: Stage | None = None) -> ModelCheckpoint:
    """Open a Hugging Face folder (or a GGUF file: checkpoint/gguf/) and check every tensor the config implies:
    presence, shape, dtype. stage: one pipeline rank's layers (checkpoint/stage.py): the folder may then hold only
    the shards they need (a local copy on each node); only the units the stage owns are opened and checked, and
    the embedding where the last stage finds it (MTP layers read it)."""
    if is_gguf(path):
        from .gguf.model import open_gguf_model

        return open_gguf_model(path)
    index = CheckpointIndex.open(path, missing_shards_ok=stage is not None)
    config_path = index.root / "config.json"
    spec = parse_config(index.config, config_path)
    arch = get_naming(spec.model_type, config_path)
    if spec.num_layers > len(index.tensors):
        raise CheckpointFormatError(config_path, f"num_hidden_layers={spec.num_layers} but the checkpoint holds only "
                                                 f"{len(index.tensors)} tensors")
    # the weight format, from config.json (refused by name when unsupported) and the tensor headers
    quant = parse_quant_config(index.config.get("quantization_config", spec.get("quantization_config")),
                               config_path)
    args = arch.args(spec)
    if quant is not None:  # the architecture's MTP schema (added later: runtime/mtp.py) is quantized alike
        args = dataclasses.replace(args, formats=WeightFormats(quant, index.tensors))
    fused = fused_expert_layout(index.tensors, spec.num_layers)
    schema = arch.schema(args, fused_experts=fused)
    if stage is not None:
        schema = stage_schema(schema, stage, index)
    schema, formats = quantize_schema(schema, quant, index.tensors)
    _check_tensors(index, spec, schema, config_path, allow_cast)
    layouts = {key: build_layout(key, specs, index.tensors) for key, specs in schema.units.items()}
    unused = sorted(set(index.tensors) - schema.hf_names())
    return ModelCheckpoint(index.root, index, spec, arch, args, schema, layouts, fused, unused, quant, formats)


def stage_schema(schema: ModelSchema, stage: Stage, index: CheckpointIndex) -> ModelSchema:
    """The units `stage` owns (the last stage's embedding only where its shard is here: without it the rank runs
    without MTP layers)."""
    def here(specs) -> bool:
        return all(ts.hf_name in index.tensors for ts in specs.values())

    units = {key: specs for key, specs in schema.units.items()
             if stage.owns(key) or (key.kind == "embed" and stage.last and here(specs))}
    return dataclasses.replace(schema, units=units)


def _check_tensors(index: CheckpointIndex, spec: ModelSpec, schema: ModelSchema, config_path: Path,
                   allow_cast: bool) -> None:
    want_dtype = TORCH_DTYPE_NAMES.get(spec.dtype)
    quantized = "quantization_config" in spec.raw or "quantization_config" in index.config
    dtype_mismatches = []
    for key, specs in schema.units.items():
        for local, ts in specs.items():
            rec = index.tensors.get(ts.hf_name)
            if rec is None and ts.hf_name in index.absent:
                raise CheckpointFormatError(index.root, f"unit {key} needs shard '{index.absent[ts.hf_name].name}', "
                                                        f"which is not in this folder", tensor=ts.hf_name,
                                            hint="copy the shards that hold this rank's layers")
            if rec is None:
                raise CheckpointFormatError(index.root, f"tensor missing: config.json (model_type={spec.model_type}) "
                                                        f"implies it for unit {key} with shape {list(ts.shape)}"
                                                        f"{_siblings(index, ts.hf_name) if quantized else ''}",
                                            tensor=ts.hf_name)
            expected = ts.shape if ts.index is None else None
            if ts.index is not None:
                if len(rec.shape) != len(ts.shape) + 1 or rec.shape[1:] != ts.shape or ts.index >= rec.shape[0]:
                    expected = (f"[>{ts.index}, " + ", ".join(map(str, ts.shape)) + "]")
                    raise CheckpointFormatError(rec.file, f"shape {list(rec.shape)} disagrees with config.json: "
                                                          f"expected {expected}", tensor=rec.name)
            elif tuple(rec.shape) != tuple(expected):
                raise CheckpointFormatError(rec.file, f"shape {list(rec.shape)} disagrees with config.json: expected "
                                                      f"{list(expected)}", tensor=rec.name)
            if ts.dtype == "any":  # e.g. routers kept in float32 inside bf16 checkpoints (DeepSeek-V3)
                continue
            if ts.dtype is not None and rec.dtype != ts.dtype:
                dtype_mismatches.append((rec, ts.dtype))
            elif (ts.dtype is None and want_dtype and not quantized and rec.dtype in FLOAT_DTYPES
                  and len(rec.shape) >= 2 and rec.dtype != want_dtype):
                dtype_mismatches.append((rec, want_dtype))
    if dtype_mismatches and not allow_cast:
        rec, want = dtype_mismatches[0]
        more = "; ".join(f"{r.name}: {r.dtype}" for r, _ in dtype_mismatches[1:4])
        raise CheckpointFormatError(
            rec.file, f"dtype {rec.dtype} disagrees with config.json torch_dtype={spec.dtype} (expected {want})"
                      f"{'; also ' + more if more else ''} ({len(dtype_mismatches)} tensors in all)",
            tensor=rec.name, hint="pass allow_cast=True (CLI: --allow-cast) to convert")


def _siblings(index: CheckpointIndex, hf_name: str) -> str:
    """A quantized weight whose data tensor is gone while its scales remain: say what is there."""
    stem = hf_name.removesuffix(".weight")
    found = sorted(n for n in index.tensors if n.startswith(stem) and n != hf_name and n[len(stem)] in "._")
    return f" (only {', '.join(found[:4])} found: its quantized data tensor is missing)" if found else ""
