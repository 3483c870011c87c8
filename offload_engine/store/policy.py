"""Eviction policies as pure functions: given the evictable slots' usage records, pick a victim.

FIELD-NOTES: a global LRU collapses to 0% hits once the cache is smaller than one token's experts across all
layers (sequential flooding: layer l's experts are always evicted just before they are needed again); a
per-layer partition keeps a share of slots per layer and evicts within the incoming unit's layer.

lru-floor (the default) is a global LRU that takes a unit from another layer only while that layer holds more
than a floor: the experts one token routes to per layer (top-k). Its slots follow the layers that need them
instead of an equal share, and the floor keeps the flood from starting. Where the cache has little room above
every layer's floor, it is layer-lru (resolved). Measured in docs/PERF.md.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Mapping, NamedTuple, Sequence

from ..modes import POLICIES

FLOOR_ROOM = 2  # lru-floor needs slots for twice every layer's floor, else it is layer-lru (see resolved)
LFU_HALF_LIFE = 64.0  # uses: older accesses count half after this many store ticks


class Usage(NamedTuple):  # a tuple, not a dataclass: the store builds one per evictable slot on every miss
    slot: int
    layer: int
    last_use: int  # store tick of the last acquire
    score: float  # LFU: aged access count


def aged_count(score: float, last_tick: int, now: int) -> float:
    """LFU with exponential aging: a unit hot long ago loses to one used recently."""
    return score * math.pow(0.5, (now - last_tick) / LFU_HALF_LIFE)


def choose_victim(policy: str, candidates: Sequence[Usage], incoming_layer: int, layer_share: int, now: int,
                  layer_floor: int = 1, occupied: Mapping[int, int] | None = None) -> int:
    """Index (slot) of the unit to evict. `layer_share` = slots per layer under the per-layer partition;
    `layer_floor` = the units lru-floor leaves a layer; `occupied` = units per layer, held ones included
    (default: the candidates')."""
    if not candidates:
        raise ValueError("no evictable slot")
    policy = resolved(policy, layer_share, layer_floor)
    if policy == "lru":
        return min(candidates, key=lambda u: (u.last_use, u.slot)).slot
    if policy == "lru-floor":
        per_layer = occupied if occupied is not None else Counter(u.layer for u in candidates)
        kept = [u for u in candidates if may_take(u.layer, incoming_layer, layer_floor, per_layer)]
        return min(kept or candidates, key=lambda u: (u.last_use, u.slot)).slot
    if policy == "lfu":
        return min(candidates, key=lambda u: (aged_count(u.score, u.last_use, now), u.last_use, u.slot)).slot
    if policy == "layer-lru":
        per_layer: dict[int, int] = {}
        for u in candidates:
            per_layer[u.layer] = per_layer.get(u.layer, 0) + 1
        layer = layer_to_evict(per_layer.get(incoming_layer, 0), layer_share, per_layer, incoming_layer)
        return min((u for u in candidates if u.layer == layer), key=lambda u: (u.last_use, u.slot)).slot
    raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")


def may_take(layer: int, incoming_layer: int, layer_floor: int, occupied: Mapping[int, int]) -> bool:
    """lru-floor: a unit of `layer` may make room for one of `incoming_layer` when it is the same layer or
    `layer` holds more than its floor (`occupied`: units per layer)."""
    return layer == incoming_layer or occupied.get(layer, 0) > layer_floor


def resolved(policy: str, layer_share: int, layer_floor: int) -> str:
    """lru-floor is layer-lru until the slots give every layer FLOOR_ROOM times its floor. The store reserves a
    layer's misses before that layer's hits are released, so a layer at its floor cannot recycle its own slots
    and takes from the layers above theirs; with little room above the floors that costs more than the
    partition. On the bench model, misses per token against layer-lru (greedy / sampled text): room 1x +11%
    / -, 1.5x 0% / +4%, 2x -9% / -10%, 2.4x -3% / -20%, 3.6x -4% / -16%; below 1x (nothing above any floor) a
    floor leaves a layer's misses to take from the next layer, that one's from the next: every expert missed."""
    return "layer-lru" if policy == "lru-floor" and layer_share < FLOOR_ROOM * layer_floor else policy


def layer_to_evict(own: int, layer_share: int, per_layer: Mapping[int, int], incoming_layer: int) -> int:
    """layer-lru: evict within the incoming unit's layer once it holds its share (`own` units), otherwise from
    the layer holding the most (`per_layer`: units per layer; ties: the lowest layer)."""
    if (own and own >= layer_share) or not per_layer:
        return incoming_layer
    return max(per_layer, key=lambda l: (per_layer[l], -l))
