"""Row kinds (the embedding) read by rows: a lookup needs one row per token, never the whole table.

Where the placement pins a row kind nowhere (Placement.by_rows) it gets no slot; a forward's distinct token ids
become byte ranges of the checkpoint (adjacent ids merged), read into a fresh buffer by the store's readers,
and the lookup runs on those rows with the ids renumbered into them: the same gather, the same bits. The rows
looked up last stay in a RowCache (charged to the compute tier by the placement: ROW_CACHE_BYTES), so a step
whose token was seen lately reads nothing.
"""
from __future__ import annotations

from collections import OrderedDict
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


def row_bytes(tensor: TensorSlice) -> int:
    """Bytes of one row of a row kind's table."""
    return tensor.nbytes // tensor.shape[0]


def plan_rows(layout: UnitLayout, ids: torch.Tensor) -> RowRequest:
    tensor = row_tensor(layout)
    count = tensor.shape[0]
    unique, local = torch.unique(ids.cpu(), return_inverse=True)
    rows = unique.tolist()
    if rows and (rows[0] < 0 or rows[-1] >= count):
        bad = rows[0] if rows[0] < 0 else rows[-1]
        raise IndexError(f"token id {bad} is outside {layout.key}'s {count} rows ({tensor.local} in {tensor.file})")
    size = row_bytes(tensor)
    ranges: list[ReadRange] = []
    start = 0
    for i in range(1, len(rows) + 1):  # one range per run of consecutive ids
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            ranges.append(ReadRange(tensor.file, tensor.file_offset + rows[start] * size, (i - start) * size,
                                    start * size))
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


class RowCache:
    """The last `capacity` distinct rows of one table looked up (least recently used out), as raw bytes in one
    [capacity, row size] buffer on the compute device."""

    def __init__(self, capacity: int, size: int, device: torch.device):
        self.buffer = torch.empty(capacity, size, dtype=torch.uint8, device=device)
        self._where: OrderedDict[int, int] = OrderedDict()  # row id -> buffer row, least recently used first

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0]

    def lookup(self, rows: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(positions in `rows` cached, their buffer rows, positions to read)."""
        cached, slots, missing = [], [], []
        for i, row in enumerate(rows):
            slot = self._where.get(row)
            if slot is None:
                missing.append(i)
            else:
                self._where.move_to_end(row)
                cached.append(i)
                slots.append(slot)
        return cached, slots, missing

    def insert(self, rows: list[int], data: torch.Tensor) -> None:
        """Keep `rows` (not cached; `data` [len(rows), row size] uint8 on the buffer's device), evicting the least
        recently used: of a lookup larger than the cache (a prefill), the last rows."""
        keep = rows[-self.capacity:] if self.capacity else []
        data = data[len(rows) - len(keep):]
        slots = []
        for row in keep:
            if len(self._where) < self.capacity:
                slot = len(self._where)
            else:
                _, slot = self._where.popitem(last=False)
            self._where[row] = slot
            slots.append(slot)
        if slots:
            self.buffer[torch.tensor(slots, device=self.buffer.device)] = data
