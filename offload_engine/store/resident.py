"""Every unit read once and kept: the reference WeightSource (and the fastest when everything fits)."""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..checkpoint.formats import keeps_stored_dtype
from ..checkpoint.model import ModelCheckpoint
from ..checkpoint.naming import UnitKey
from .disk import ShardFiles, read_unit
from .weights import Weights


def convert(weights: Weights, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain floating tensors to the compute dtype on the compute device; integer tensors and a quantized weight's
    parts keep their dtype."""
    return {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() and not keeps_stored_dtype(k)
                else v.to(device)).contiguous()
            for k, v in weights.items()}


class ResidentWeights:
    def __init__(self, checkpoint: ModelCheckpoint, device: torch.device, dtype: torch.dtype, progress: bool = False):
        self.files = ShardFiles(checkpoint.index.shards)
        self.units: dict[UnitKey, dict[str, torch.Tensor]] = {}
        try:
            bar = tqdm(total=checkpoint.total_bytes, unit="B", unit_scale=True, desc="loading", disable=not progress)
            for key, layout in checkpoint.layouts.items():
                blob = torch.empty(layout.nbytes, dtype=torch.uint8)
                read_unit(self.files, layout, blob)
                self.units[key] = convert(layout.views(blob), device, dtype)
                bar.update(layout.nbytes)
            bar.close()
        finally:
            self.files.close()

    def acquire(self, keys: Sequence[UnitKey], while_waiting: Callable[[], None] | None = None,
                on_host: Callable[[UnitKey], bool] | None = None,
                after_resident: Callable[[], None] | None = None) -> Iterator[tuple[UnitKey, Weights]]:
        """Everything is resident: nothing is ever waited for (`while_waiting` is never called) nor held
        elsewhere (`on_host` is never asked); `after_resident` is called after the last unit."""
        for key in keys:
            yield key, self.units[key]
        if after_resident is not None:
            after_resident()

    def release(self, keys: Sequence[UnitKey]) -> None:
        pass
