"""ModelCheckpoint: an opened checkpoint (a Hugging Face folder, checkpoint/model.py, or a GGUF file,
checkpoint/gguf/model.py), its units' layouts and formats, checked before anything is loaded."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .formats import QuantSpec
from .index import CheckpointIndex
from .hf_config import ModelSpec
from .layout import UnitLayout
from .naming import ModelSchema, UnitKey
from .quant_config import QuantConfig


@dataclass(frozen=True)
class PrebuiltUnits:
    """Units a reader resolved itself that the checkpoint does not load by default: a GGUF file's MTP layers,
    whose names, formats and load-time fix-ups are the file's (checkpoint/gguf/model.py).
    runtime/mtp.attach_mtp_units adds them as they are."""
    schema: ModelSchema
    layouts: dict[UnitKey, UnitLayout]
    formats: dict[str, QuantSpec]
    tensors: frozenset[str]  # the file's tensors they hold (unused until attached)


@dataclass
class ModelCheckpoint:
    root: Path
    index: CheckpointIndex
    spec: ModelSpec
    arch: Any  # the architecture's naming half (checkpoint/arch/): name, args, schema, mtp_schema
    args: Any  # the architecture's ModelArgs
    schema: ModelSchema
    layouts: dict[UnitKey, UnitLayout]
    fused_experts: bool
    unused_tensors: list[str] = field(default_factory=list)
    quant: QuantConfig | None = None  # config.json's quantization_config, parsed
    formats: dict[str, QuantSpec] = field(default_factory=dict)  # quantized weight (checkpoint name) -> format
    mtp: PrebuiltUnits | None = None  # MTP units resolved by the reader (GGUF), else found by attach_mtp_units

    def unit_bytes(self, key: UnitKey) -> int:
        return self.layouts[key].nbytes

    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, layout in self.layouts.items():
            out[key.kind] = out.get(key.kind, 0) + layout.nbytes
        return out

    @property
    def total_bytes(self) -> int:
        return sum(layout.nbytes for layout in self.layouts.values())
