"""Where a unit's tensors lie on disk and inside its one contiguous blob.

A unit is read into one blob (one copy per tier move); its tensors are views at fixed offsets. Slices are laid
out in file order with only the padding their dtype's alignment needs, so tensors adjacent on disk stay
adjacent in the blob and one unit is usually one read per shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from .formats import check_component_data, needs_data_check
from .index import DTYPES, TensorRecord
from .naming import TensorSpec, UnitKey


@dataclass(frozen=True)
class TensorSlice:
    local: str
    file: Path
    file_offset: int
    nbytes: int
    blob_offset: int
    dtype: str
    shape: tuple[int, ...]
    tensor: str = ""  # the checkpoint's name for it (error messages)


@dataclass(frozen=True)
class ReadRange:
    file: Path
    file_offset: int
    nbytes: int
    blob_offset: int


@dataclass(frozen=True)
class UnitLayout:
    key: UnitKey
    slices: tuple[TensorSlice, ...]
    nbytes: int  # blob size

    def views(self, blob: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed tensor views into a uint8 blob holding this unit's bytes."""
        out = {}
        for s in self.slices:
            raw = blob[s.blob_offset:s.blob_offset + s.nbytes]
            out[s.local] = raw.view(DTYPES[s.dtype][1]).view(s.shape)
        if self._data_checks:  # quantized weights: what only the data can say, checked where the unit lands
            check_component_data(self._data_checks, out)
        return out

    @cached_property
    def _data_checks(self) -> tuple[TensorSlice, ...]:
        return tuple(s for s in self.slices if needs_data_check(s.local))

    def read_ranges(self) -> tuple[ReadRange, ...]:
        """Byte ranges to read, adjacent ones merged (same file, contiguous on disk and in the blob)."""
        return self._read_ranges

    @cached_property
    def single_range(self) -> ReadRange | None:
        """The unit's one read range when its bytes are one run of the file laid out in the blob from offset 0
        and every tensor starts at a multiple of its element size in the file, so the blob may start at any
        offset of the file's page and the typed views stay aligned (store/disk.read_unit_direct); else None."""
        ranges = self.read_ranges()
        if len(ranges) != 1 or ranges[0].blob_offset != 0:
            return None
        return None if any(s.file_offset % dtype_align(s.dtype) for s in self.slices) else ranges[0]

    @cached_property  # asked on every read of the unit, by a reader thread holding the GIL
    def _read_ranges(self) -> tuple[ReadRange, ...]:
        ranges: list[ReadRange] = []
        for s in self.slices:
            last = ranges[-1] if ranges else None
            if (last is not None and last.file == s.file and last.file_offset + last.nbytes == s.file_offset
                    and last.blob_offset + last.nbytes == s.blob_offset):
                ranges[-1] = ReadRange(last.file, last.file_offset, last.nbytes + s.nbytes, last.blob_offset)
            else:
                ranges.append(ReadRange(s.file, s.file_offset, s.nbytes, s.blob_offset))
        return tuple(ranges)


def dtype_align(dtype: str) -> int:
    """Bytes a typed view of `dtype` must start at a multiple of (its element size)."""
    return max(1, DTYPES[dtype][0] // 8)


def build_layout(key: UnitKey, specs: dict[str, TensorSpec], records: dict[str, TensorRecord]) -> UnitLayout:
    parts = []
    for local, spec in specs.items():
        rec = records[spec.hf_name]
        offset, nbytes = rec.offset, rec.nbytes
        if spec.index is not None:  # one expert's slice of a fused [E, ...] tensor
            nbytes = rec.nbytes // rec.shape[0]
            offset = rec.offset + spec.index * nbytes
        parts.append((rec.file, offset, nbytes, local, rec.dtype, spec.shape, spec.hf_name))
    parts.sort(key=lambda p: (str(p[0]), p[1]))
    slices, pos = [], 0
    for file, offset, nbytes, local, dtype, shape, name in parts:
        align = dtype_align(dtype)
        pos = -(-pos // align) * align
        slices.append(TensorSlice(local, file, offset, nbytes, pos, dtype, tuple(shape), name))
        pos += nbytes
    return UnitLayout(key, tuple(slices), pos)
