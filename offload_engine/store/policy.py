"""Eviction policies as pure functions: given the evictable slots' usage records, pick a victim.

FIELD-NOTES: a global LRU collapses to 0% hits once the cache is smaller than one token's experts across all
layers (sequential flooding: layer l's experts are always evicted just before they are needed again); a
per-layer partition keeps a share of slots per layer and evicts within the incoming unit's layer.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

POLICIES = ("lru", "lfu", "layer-lru")
LFU_HALF_LIFE = 64.0  # uses: older accesses count half after this many store ticks


class Usage(NamedTuple):  # a tuple, not a dataclass: the store builds one per evictable slot on every miss
    slot: int
    layer: int
    last_use: int  # store tick of the last acquire
    score: float  # LFU: aged access count


def aged_count(score: float, last_tick: int, now: int) -> float:
    """LFU with exponential aging: a unit hot long ago loses to one used recently."""
    return score * math.pow(0.5, (now - last_tick) / LFU_HALF_LIFE)


def choose_victim(policy: str, candidates: Sequence[Usage], incoming_layer: int, layer_share: int, now: int) -> int:
    """Index (slot) of the unit to evict. `layer_share` = slots per layer under the per-layer partition."""
    if not candidates:
        raise ValueError("no evictable slot")
    if policy == "lru":
        return min(candidates, key=lambda u: (u.last_use, u.slot)).slot
    if policy == "lfu":
        return min(candidates, key=lambda u: (aged_count(u.score, u.last_use, now), u.last_use, u.slot)).slot
    if policy == "layer-lru":
        per_layer: dict[int, int] = {}
        for u in candidates:
            per_layer[u.layer] = per_layer.get(u.layer, 0) + 1
        layer = layer_to_evict(per_layer.get(incoming_layer, 0), layer_share, per_layer, incoming_layer)
        return min((u for u in candidates if u.layer == layer), key=lambda u: (u.last_use, u.slot)).slot
    raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")


def layer_to_evict(own: int, layer_share: int, per_layer: Mapping[int, int], incoming_layer: int) -> int:
    """layer-lru: evict within the incoming unit's layer once it holds its share (`own` units), otherwise from
    the layer holding the most (`per_layer`: units per layer; ties: the lowest layer)."""
    if (own and own >= layer_share) or not per_layer:
        return incoming_layer
    return max(per_layer, key=lambda l: (per_layer[l], -l))
