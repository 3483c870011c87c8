"""The seam between the runtime and whatever holds the weights (DESIGN: the runtime *asks* for weights).

`acquire` yields units resident first and the others as they become available; the caller computes on each as
it arrives and calls `release` when done, after which the source may evict them. A source that would block on
reads first calls the caller's `while_waiting` (once), so the caller can use the wait; `after_resident` (once)
when the units it held at the call have all been handed over. A source may also offer
`acquire_ready(keys)`: all of them at once where all are resident, else None (TieredStore.acquire_ready); and
`rows(key, ids)`: the rows a lookup needs of a table it does not hold whole (the embedding; see `lookup`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Protocol, Sequence

import torch

from ..checkpoint.naming import UnitKey
from ..store.weights import Weights

__all__ = ["Weights", "WeightSource", "hold", "lookup"]


class WeightSource(Protocol):
    def acquire(self, keys: Sequence[UnitKey], while_waiting: Callable[[], None] | None = None,
                on_host: Callable[[UnitKey], bool] | None = None,
                after_resident: Callable[[], None] | None = None) -> Iterator[tuple[UnitKey, Weights]]: ...
    def release(self, keys: Sequence[UnitKey]) -> None: ...


@contextmanager
def hold(source: WeightSource, key: UnitKey) -> Iterator[Weights]:
    """One unit for the duration of a `with` block. Released exactly once whatever interrupts it: a
    KeyboardInterrupt that lands while `acquire` finishes (after the unit was handed over) or before the block
    starts would otherwise leak the reference, and the slot could never be evicted again."""
    ready = getattr(source, "acquire_ready", None)
    taken = None
    try:  # a resident unit is handed over at once, without acquire's generator
        taken = ready([key]) if ready is not None else None
        if taken is not None:
            yield taken[0]
    finally:
        if taken is not None:
            source.release([key])
    if taken is not None:
        return
    units = source.acquire([key])
    got = False
    try:
        _, w = next(units)
        got = True  # no call between the hand-over and this flag: nothing can interrupt in between
        yield w
    finally:
        try:
            units.close()  # its own cleanup gives back only what it never handed over
        finally:
            if got:
                source.release([key])


def lookup(source: WeightSource, key: UnitKey, ids: torch.Tensor,
           fn: Callable[[Weights, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(weights, ids) for a table lookup (the embedding): on just the rows `ids` use where the source reads
    them on demand (TieredStore.rows, with `ids` renumbered into them), else on the whole unit."""
    rows = getattr(source, "rows", None)
    got = rows(key, ids) if rows is not None else None
    if got is not None:
        return fn(*got)
    with hold(source, key) as w:
        return fn(w, ids)
