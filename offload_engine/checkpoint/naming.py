"""Units: the grain of weight movement, and the schema that says which checkpoint bytes make up each one.

An architecture describes its model as a `ModelSchema`: for every `UnitKey`, the tensors it needs (`TensorSpec`:
checkpoint name, expected shape, and for fused `[E, ...]` expert tensors the expert's index along dim 0).
The same schema serves validation (every expected tensor is present with its shape), the store (a unit's byte
ranges), the planner (sizes from config alone) and the runtime (local names of a unit's tensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

UNIT_KINDS = ("embed", "dense", "expert", "head", "mtp")


class UnitKey(NamedTuple):
    layer: int  # -1 for embed; num_layers for head; num_layers + i for MTP layer i
    kind: str  # one of UNIT_KINDS
    expert: int = -1

    def __str__(self) -> str:
        if self.kind == "expert":
            return f"L{self.layer}.E{self.expert}"
        if self.kind in ("embed", "head"):
            return self.kind
        return f"L{self.layer}.{self.kind}"


@dataclass(frozen=True)
class TensorSpec:
    hf_name: str  # name in the checkpoint
    shape: tuple[int, ...]  # shape of this unit's part (for fused experts: one expert's slice)
    index: int | None = None  # fused `[E, ...]` tensor: which slice along dim 0
    dtype: str | None = None  # expected safetensors dtype when fixed by the format; "any": any float dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class ModelSchema:
    units: dict[UnitKey, dict[str, TensorSpec]] = field(default_factory=dict)

    def add(self, key: UnitKey, local: str, spec: TensorSpec) -> None:
        self.units.setdefault(key, {})[local] = spec

    def keys(self, kind: str | None = None) -> Iterator[UnitKey]:
        return (k for k in self.units if kind is None or k.kind == kind)

    def hf_names(self) -> set[str]:
        return {s.hf_name for specs in self.units.values() for s in specs.values()}

    def unit_numel(self, key: UnitKey) -> int:
        return sum(s.numel for s in self.units[key].values())
