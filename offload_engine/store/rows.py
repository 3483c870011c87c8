"""Row kinds (the embedding) read by rows: a lookup needs one row per token, never the whole table.

Where the placement pins a row kind nowhere (Placement.by_rows) it gets no slot; a forward's distinct token ids
become byte ranges of the checkpoint (adjacent ids merged), read into a fresh buffer by the store's readers,
and the lookup runs on those rows with the ids renumbered into them: the same gather, the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checkpoint.layout import ReadRange, TensorSlice, UnitLayout
from ..errors import ConfigError


@dataclass(frozen=True)
class RowRequest:
    tensor: TensorSlice  # the unit's one 2-D tensor
    rows: list[int]  # distinct row ids, ascending
    local_ids: torch.Tensor  # the lookup's ids renumbered into `rows`
    ranges: list[ReadRange]  # runs of adjacent rows; blob offsets into a buffer of len(rows) rows

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)


def row_tensor(layout: UnitLayout) -> TensorSlice:
    """The one 2-D tensor of a row kind's unit (a table indexed by token id)."""
    if len(layout.slices) != 1 or len(layout.slices[0].shape) != 2:
        raise ConfigError(f"{layout.key} must be one 2-D table to be read by rows; it holds "
                          f"{[(s.local, s.shape) for s in layout.slices]}")
    return layout.slices[0]


def plan_rows(layout: UnitLayout, ids: torch.Tensor) -> RowRequest:
    tensor = row_tensor(layout)
    count = tensor.shape[0]
    unique, local = torch.unique(ids.cpu(), return_inverse=True)
    rows = unique.tolist()
    if rows and (rows[0] < 0 or rows[-1] >= count):
        bad = rows[0] if rows[0] < 0 else rows[-1]
        raise IndexError(f"token id {bad} is outside {layout.key}'s {count} rows ({tensor.local} in {tensor.file})")
    row_bytes = tensor.nbytes // count
    ranges: list[ReadRange] = []
    start = 0
    for i in range(1, len(rows) + 1):  # one range per run of consecutive ids
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            ranges.append(ReadRange(tensor.file, tensor.file_offset + rows[start] * row_bytes,
                                    (i - start) * row_bytes, start * row_bytes))
            start = i
    return RowRequest(tensor, rows, local.view(ids.shape), ranges)


def split(ranges: list[ReadRange], parts: int) -> list[list[ReadRange]]:
    """At most `parts` groups of about equal bytes, for the reader threads (a prefill reads many rows)."""
    total = sum(r.nbytes for r in ranges)
    groups: list[list[ReadRange]] = [[]]
    done = 0
    for r in ranges:
        if groups[-1] and done >= total * len(groups) / parts:
            groups.append([])
        groups[-1].append(r)
        done += r.nbytes
    return groups
