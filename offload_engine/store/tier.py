"""Fixed-size slot pools, allocated once per tier and charged to the ledger before allocation."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..checkpoint.naming import UnitKey
from ..errors import out_of_memory_as_error
from .ledger import Ledger


@dataclass(eq=False)
class Slot:
    tier: str
    kind: str
    index: int
    blob: torch.Tensor  # uint8, slot_bytes long
    offset: int = 0  # where the unit's bytes begin in blob (a direct read lands them page-shifted)
    key: UnitKey | None = None
    refs: int = 0  # acquired and not yet released: never evicted
    loading: Future | None = None  # a read or copy into this slot is in flight
    last_use: int = 0
    score: float = 0.0  # aged use count (LFU)
    prefetched: bool = False  # filled by a prefetch and not yet used
    stale: bool = False  # a prefetch its layer's routing did not use: the first victim of any read
    # typed views of the unit last viewed here, for which (key, offset), and whether they need a cast to the
    # compute dtype: valid while (key, offset) match, a unit's layout in its blob being fixed (building them
    # costs ~30 us of Python per acquire)
    views: tuple[tuple[UnitKey, int], dict[str, torch.Tensor], bool] | None = None


@dataclass(eq=False)
class Tier:
    name: str
    device: torch.device
    pinned_kinds: set[str]
    pools: dict[str, list[Slot]] = field(default_factory=dict)
    resident: dict[UnitKey, Slot] = field(default_factory=dict)

    def allocate(self, kind: str, count: int, slot_bytes: int, ledger: Ledger, pin_memory: bool) -> None:
        pool = self.pools.setdefault(kind, [])
        for _ in range(count):
            ledger.charge(self.name, slot_bytes, f"{kind} slots")
            try:
                with out_of_memory_as_error(f"{self.name} tier ({self.device}): {kind} slot of {slot_bytes} bytes"):
                    blob = torch.empty(slot_bytes, dtype=torch.uint8, device=self.device, pin_memory=pin_memory)
            except BaseException:  # the allocator refused (memory used outside the budget): the charge is void
                ledger.credit(self.name, slot_bytes, f"{kind} slots")
                raise
            pool.append(Slot(self.name, kind, len(pool), blob))

    def free_all(self, ledger: Ledger) -> None:
        for kind, pool in self.pools.items():
            for slot in pool:
                ledger.credit(self.name, slot.blob.numel(), f"{kind} slots")
        self.pools.clear()
        self.resident.clear()
