"""Values derived from a unit's weight views, kept while those views live.

A slot builds its unit's views once per fill (store/tier.Slot.views) and hands the same tensors to every acquire,
so a view's identity names the fill: what a decode step derives from it (a routed expert's tuple of kernel forms,
~7 us of dict lookups and checks per expert, 96 experts a token on the bench model) is computed once per fill
instead of once per use.
"""
from __future__ import annotations

import weakref
from typing import Callable, Generic, TypeVar

import torch

V = TypeVar("V")


class PerFill(Generic[V]):
    """get(anchor, make): make() once per live anchor tensor. Keyed by the anchor's id and checked by a weak
    reference (an id is reused once its tensor is gone). A value may hold its anchor (a kernel tuple holds the
    views), which then lives until the table is cleared: at most `limit` entries (a few KB each: views, no
    weight bytes), the table cleared when full (streamed units bring new views at every fill)."""

    def __init__(self, limit: int = 8192):
        self._items: dict[int, tuple[weakref.ref, V]] = {}
        self._limit = limit

    def get(self, anchor: torch.Tensor, make: Callable[[], V]) -> V:
        hit = self._items.get(id(anchor))
        if hit is not None and hit[0]() is anchor:
            return hit[1]
        value = make()
        if len(self._items) >= self._limit:
            self._items.clear()
        self._items[id(anchor)] = (weakref.ref(anchor), value)
        return value
