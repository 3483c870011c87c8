"""A pipeline stage: the contiguous range of decoder layers one rank runs, and the units it therefore holds.

The seam pipeline parallelism (offload_engine/distributed/) uses to give one rank a part of the model: its store,
placement and KV cache are planned from `restrict(checkpoint, stage)`, so the rank reads only its own layers' units
from the checkpoint. The first stage embeds the tokens; the last one owns the head and the MTP layers (and the
embedding rows an MTP layer reads for its tokens). A single-process engine has no stage: every unit.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .naming import UnitKey


@dataclass(frozen=True)
class Stage:
    """Decoder layers [start, stop) of a model of `num_layers` layers."""

    start: int
    stop: int
    num_layers: int

    def __post_init__(self):
        if not 0 <= self.start < self.stop <= self.num_layers:
            raise ValueError(f"a stage holds layers [start, stop) within [0, {self.num_layers}): got "
                             f"[{self.start}, {self.stop})")

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.stop == self.num_layers

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    def owns(self, key: UnitKey, with_mtp: bool = False) -> bool:
        """Whether this stage's store holds `key`. with_mtp: the checkpoint's MTP units are attached (the last
        stage then also holds the embedding, which MTP layers read for their tokens)."""
        if key.kind == "embed":
            return self.first or (self.last and with_mtp)
        if key.kind in ("head", "mtp") or key.layer >= self.num_layers:  # MTP layers' experts are numbered after
            return self.last
        return self.start <= key.layer < self.stop

    def describe(self) -> str:
        parts = [f"layers {self.start}-{self.stop - 1}"]
        if self.first:
            parts.insert(0, "embedding")
        if self.last:
            parts.append("head")
        return ", ".join(parts)


def restrict(checkpoint, stage: Stage | None):
    """The checkpoint (a ModelCheckpoint) with only the units `stage` holds (None: unchanged)."""
    if stage is None:
        return checkpoint
    with_mtp = any(k.kind == "mtp" for k in checkpoint.layouts)
    layouts = {k: v for k, v in checkpoint.layouts.items() if stage.owns(k, with_mtp)}
    units = {k: v for k, v in checkpoint.schema.units.items() if stage.owns(k, with_mtp)}
    return dataclasses.replace(checkpoint, layouts=layouts, schema=dataclasses.replace(checkpoint.schema, units=units))
