"""Weight formats per tensor: which linear weights a checkpoint stores quantized, and the tensors that make them.

`quantize_schema` rewrites a ModelSchema so each quantized weight is replaced, inside the same unit, by its
component tensors (quantized data, scales, zeros, g_idx, shape): the unit stays one contiguous blob of the bytes
on disk, moved as-is by the store. Only the runtime's linear op (runtime/linear.py) turns them back into math.

Component local names carry the weight's `QuantSpec`: the quantized data is `<local>@q:<tag>` and the others
`<local>@scale`, `@zero`, `@g_idx`, `@shape`, so a unit's tensors describe themselves wherever they are handed.
Each format's recogniser (its header checks) lives in its module in formats/ (the QuantSpec and the component
names: formats/spec.py). Every check reads headers only; what only the data can say (GPTQ g_idx in range, CT
weight_shape values) is checked when the weight is first dequantized, naming the same file and tensor.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import torch

from ..errors import CheckpointFormatError
from ..formats.registry import METHODS, format_of
from ..formats.spec import (F8, FLOATS, MARK, PARTS, PRIMARY, QuantSpec, Recognition, decode, encode,  # noqa: F401
                            part_name, primary_name)
from .index import TensorRecord
from .naming import ModelSchema, TensorSpec
from .quant_config import QuantConfig


@dataclass(frozen=True, eq=False)
class WeightFormats:
    """A checkpoint's quantization config with its tensor headers: what an architecture's extra schemas (MTP
    layers) need to be quantized like the main one (DecoderArgs.formats)."""

    config: QuantConfig
    tensors: Mapping[str, TensorRecord]

    def apply(self, schema: ModelSchema) -> ModelSchema:
        return quantize_schema(schema, self.config, self.tensors)[0]


def is_linear_weight(spec: TensorSpec) -> bool:
    """A matrix a linear op multiplies by: 2-D (or one expert's slice of a fused tensor), not an embedding."""
    return len(spec.shape) == 2 and "embed_tokens" not in spec.hf_name and (
        spec.index is not None or spec.hf_name.endswith(".weight"))


def quantize_schema(schema: ModelSchema, cfg: QuantConfig | None, tensors: Mapping[str, TensorRecord]
                    ) -> tuple[ModelSchema, dict[str, QuantSpec]]:
    """The schema with each quantized weight replaced by its components, and hf name -> QuantSpec of those."""
    if cfg is None:
        return schema, {}
    recognise = METHODS[cfg.method].recognise
    found: dict[str, QuantSpec] = {}
    units = {}
    for key, specs in schema.units.items():
        out: dict[str, TensorSpec] = {}
        for local, spec in specs.items():
            q = None
            if is_linear_weight(spec):
                c = Recognition(local, spec, tensors)
                q = recognise(c, cfg)
            if q is None:
                out[local] = spec
            else:
                out.update(c.parts)
                found[spec.hf_name] = q
        units[key] = out
    return dataclasses.replace(schema, units=units), found


def format_summary(found: Mapping[str, QuantSpec]) -> str:
    """e.g. 'fp8_block 128x128 (94 weights)' for inspect-style output."""
    kinds: dict[str, int] = {}
    for q in found.values():
        label = format_of(q).label(q)
        kinds[label] = kinds.get(label, 0) + 1
    return ", ".join(f"{k} ({n} weights)" for k, n in sorted(kinds.items())) or "none"


def keeps_stored_dtype(local: str) -> bool:
    """A quantized weight's data, scales and zeros stay as stored in every tier (the store casts plain floating
    tensors to the compute dtype; fp8 data or fp32 scales cast to bf16 would grow or lose precision)."""
    return MARK in local


def needs_data_check(local: str) -> bool:
    return local.endswith((MARK + "g_idx", MARK + "shape"))


def spec_of(local_part: str, views: Mapping[str, object]) -> QuantSpec:
    """The QuantSpec of the weight a component `<local>@<part>` belongs to (from its primary's name)."""
    prefix = local_part.rsplit(MARK, 1)[0] + PRIMARY
    return decode(next(k for k in views if k.startswith(prefix))[len(prefix):])


def check_component_data(slices, views: Mapping[str, "torch.Tensor"]) -> None:
    """GPTQ g_idx within [0, groups) and compressed-tensors weight_shape equal to the weight's shape: data, so
    checked on a unit's views where it lands (UnitLayout.views), naming the file and tensor."""
    for s in slices:
        q, t = spec_of(s.local, views), views[s.local]
        if s.local.endswith(MARK + "g_idx"):
            groups = q.inp // q.group
            lo, hi = (int(v) for v in torch.aminmax(t.to(torch.int64)))
            if lo < 0 or hi >= groups:
                raise CheckpointFormatError(s.file, f"g_idx holds group {lo if lo < 0 else hi}, outside [0, {groups})"
                                                    f" for {q.inp} inputs in groups of {q.group}", tensor=s.tensor)
        elif [int(v) for v in t.tolist()] != [q.out, q.inp]:
            raise CheckpointFormatError(s.file, f"weight_shape holds {t.tolist()}, expected [{q.out}, {q.inp}]",
                                        tensor=s.tensor)
