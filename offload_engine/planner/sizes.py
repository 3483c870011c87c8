"""Parameter counts and bytes, derived from a ModelSchema (so from config.json alone, no weights needed)."""
from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.naming import ModelSchema


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter of the main model (MTP layers excluded)
    active: int  # per token: all non-routed parameters + top-k routed experts in each MoE layer
    mtp: int  # parameters of the multi-token-prediction layers
    by_kind: dict[str, int]


def param_counts(schema: ModelSchema, experts_per_token: int) -> ParamCounts:
    by_kind: dict[str, int] = {}
    expert_sizes: dict[int, list[int]] = {}
    seen: set[str] = set()
    for key, specs in schema.units.items():
        n = 0
        for spec in specs.values():
            # a tied head shares the embedding matrix: count its parameters once
            ident = spec.hf_name if spec.index is None else f"{spec.hf_name}[{spec.index}]"
            if ident in seen:
                continue
            seen.add(ident)
            n += spec.numel
        by_kind[key.kind] = by_kind.get(key.kind, 0) + n
        if key.kind == "expert":
            expert_sizes.setdefault(key.layer, []).append(n)
    mtp = by_kind.get("mtp", 0)
    total = sum(by_kind.values()) - mtp
    routed_active = sum(sum(sorted(sizes, reverse=True)[:experts_per_token]) for sizes in expert_sizes.values())
    active = total - by_kind.get("expert", 0) + routed_active
    return ParamCounts(total=total, active=active, mtp=mtp, by_kind=by_kind)
