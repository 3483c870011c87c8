"""Routed-expert compute: tokens grouped by expert, only routed experts touched.

Experts may arrive in any order (resident ones first, the rest as reads land); each expert's contribution is
kept and the sum is formed in ascending expert order, so the result is bitwise independent of arrival order
and therefore of placement and prefetch timing.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

ExpertFn = Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]


def routed_experts(indices: torch.Tensor) -> list[int]:
    return torch.unique(indices).tolist()


def moe_combine(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                arrivals: Iterable[tuple[int, Mapping[str, torch.Tensor]]], expert_fn: ExpertFn) -> torch.Tensor:
    """x [T, H]; indices/weights [T, k]; arrivals yields (expert id, weights) for every routed expert."""
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for e, w in arrivals:
        tok, slot = torch.where(indices == e)
        y = expert_fn(w, x[tok]) * weights[tok, slot, None].to(x.dtype)
        parts[e] = (tok, y)
    out = torch.zeros_like(x)
    for e in sorted(parts):
        tok, y = parts[e]
        out.index_add_(0, tok, y)
    return out


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE routing: softmax over all experts in fp32, top-k, optional renormalization."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return idx, top.to(logits.dtype)

