"""The seam between the runtime and whatever holds the weights (DESIGN: the runtime *asks* for weights).

`acquire` yields units resident first and the others as they become available; the caller computes on each as
it arrives and calls `release` when done, after which the source may evict them.
"""
from __future__ import annotations

from typing import Iterator, Mapping, Protocol, Sequence

import torch

from ..checkpoint.naming import UnitKey

Weights = Mapping[str, torch.Tensor]


class WeightSource(Protocol):
    def acquire(self, keys: Sequence[UnitKey]) -> Iterator[tuple[UnitKey, Weights]]: ...
    def release(self, keys: Sequence[UnitKey]) -> None: ...
