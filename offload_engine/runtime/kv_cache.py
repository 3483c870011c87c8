"""Per-layer attention cache with rewind: `trim(n)` drops the last n positions (rejected draft tokens).

Each layer stores whatever tensors its attention needs ([positions, ...] along dim 0: K and V for standard
attention, the compressed latent and the rope key for MLA). Storage is allocated once per layer at the first
append, for `capacity` positions, so growth never copies and the bytes are known up front for budgeting.
"""
from __future__ import annotations

import torch

from ..errors import BudgetError


class KVCache:
    def __init__(self, num_layers: int, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = capacity
        self.device = torch.device(device)
        self.length = 0  # committed positions
        self._store: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers

    def append(self, layer: int, *entries: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write `entries` ([T, ...] each) after the committed positions; return views over all positions."""
        t = entries[0].shape[0]
        end = self.length + t
        if end > self.capacity:
            raise BudgetError("kv-cache", end, self.capacity, hint="context (positions) exceeds the cache capacity")
        store = self._store[layer]
        if store is None:
            store = tuple(torch.empty((self.capacity, *e.shape[1:]), dtype=e.dtype, device=self.device)
                          for e in entries)
            self._store[layer] = store
        for buf, e in zip(store, entries):
            buf[self.length:end] = e
        return tuple(buf[:end] for buf in store)

    def advance(self, n: int) -> None:
        """Commit n positions written by the last forward (called once per forward, after every layer)."""
        self.length += n

    def trim(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.length}")
        self.length -= n

    def keep(self, positions: list[int]) -> None:
        """Compact: keep only these positions (ascending) of those at or after the first, e.g. an accepted tree path."""
        if not positions:
            return
        start = positions[0]
        idx = torch.tensor(positions, device=self.device)
        for store in self._store:
            if store is not None:
                for buf in store:
                    buf[start:start + len(positions)] = buf[idx]
        self.length = start + len(positions)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for s in self._store if s is not None for b in s)
