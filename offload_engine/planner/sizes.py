"""Parameter counts and bytes, derived from a ModelSchema (so from config.json alone, no weights needed).

Active parameters per token, three conventions (docs/SCALE.md, "Parameter counts"):
  with_embedding_and_head     every non-routed parameter, embedding matrix and output head included, plus the
                              top-k routed experts of each MoE layer: `ParamCounts.active`. Mistral (12.9B),
                              Qwen (3.3B, 22B), DeepSeek (37B) and Moonshot (32B) publish this count, rounded or
                              truncated to the digits they print.
  without_embedding           the same less the embedding matrix (a token reads one row of it): OpenAI's
                              convention (gpt-oss-120b 5.13B). A tied head keeps the shared matrix.
  without_embedding_and_head  less the embedding and the output head ("non-embedding" counts).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.naming import ModelSchema


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter of the main model (MTP layers excluded)
    active: int  # per token, with_embedding_and_head: all non-routed parameters + top-k routed experts per MoE layer
    mtp: int  # parameters of the multi-token-prediction layers
    by_kind: dict[str, int]
    tied_head: int = 0  # parameters the head shares with the embedding (counted once, under "embed")

    @property
    def active_by_convention(self) -> dict[str, int]:
        embed, head = self.by_kind.get("embed", 0), self.by_kind.get("head", 0)
        return {"with_embedding_and_head": self.active,
                "without_embedding": self.active - embed + self.tied_head,
                "without_embedding_and_head": self.active - embed - head}


def param_counts(schema: ModelSchema, experts_per_token: int) -> ParamCounts:
    """Counts of `schema`, which may include MTP units (a checkpoint with its MTP layers attached): every unit of
    a layer that has an `mtp` unit, its routed experts included, counts as MTP (by_kind["mtp"]), not as the main
    model's."""
    by_kind: dict[str, int] = {}
    expert_sizes: dict[int, list[int]] = {}
    seen: set[str] = set()
    mtp_layers = {key.layer for key in schema.units if key.kind == "mtp"}
    tied_head = 0
    for key, specs in schema.units.items():
        n = 0
        for spec in specs.values():
            # a tied head shares the embedding matrix: count its parameters once
            ident = spec.hf_name if spec.index is None else f"{spec.hf_name}[{spec.index}]"
            if ident in seen:
                tied_head += spec.numel if key.kind == "head" else 0
                continue
            seen.add(ident)
            n += spec.numel
        kind = "mtp" if key.layer in mtp_layers and key.kind != "head" else key.kind
        by_kind[kind] = by_kind.get(kind, 0) + n
        if kind == "expert":
            expert_sizes.setdefault(key.layer, []).append(n)
    mtp = by_kind.get("mtp", 0)
    total = sum(by_kind.values()) - mtp
    routed_active = sum(sum(sorted(sizes, reverse=True)[:experts_per_token]) for sizes in expert_sizes.values())
    active = total - by_kind.get("expert", 0) + routed_active
    return ParamCounts(total=total, active=active, mtp=mtp, by_kind=by_kind, tied_head=tied_head)
