"""Self-speculation: the target itself, restricted to the routed experts already resident on the fastest tier.

Drafting reads nothing (every expert it uses is resident) and agrees with the target wherever tokens route to
resident experts, so acceptance stays high. A token's non-resident experts are skipped and its remaining
routing weights rescaled to the original total (`experts_per_token` optionally keeps only the heaviest few).
The draft forwards append to the target's own KV cache after the committed positions (the prefix's entries
are exact, unlike a separate cache's) and are trimmed again before the verification forward.

The routing choices the unrestricted router made during drafting are the tree's expert hints: the experts the
verification pass will most likely route to, prefetched once before it.

The restriction is a LayerOps wrapper (`RestrictedRouting`) over the target's ops, run through the target's
restricted-routing view (CausalLM.view: the same checkpoint, weight source and layers, its own MoE block over
the wrapped ops, no prefetcher, host compute or native kernels), built on the first request and kept: the
runtime's layer loop is reused as is, and nothing in it is patched.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ...checkpoint.naming import UnitKey
from ...runtime.model import CausalLM
from ..tree import DraftTree, chain_with_siblings
from . import DraftBudget, TargetState, top_candidates


VIEW = "self-draft"  # the target's view this drafter runs (CausalLM.view)


class RestrictedRouting:
    """LayerOps whose `route` only picks allowed experts (per layer); every other op is the wrapped one's."""

    def __init__(self, ops: Any, experts_per_token: int | None = None):
        self._ops = ops
        self.experts_per_token = experts_per_token
        self.allowed: dict[int, torch.Tensor] | None = None  # None: unrestricted
        self.wanted: dict[int, set[int]] = {}  # layer -> experts the unrestricted router chose

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def route(self, layer: int, w: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices, weights = self._ops.route(layer, w, x)
        self.wanted.setdefault(layer, set()).update(indices.unique().tolist())
        allowed = None if self.allowed is None else self.allowed.get(layer)
        if allowed is None or allowed.numel() == 0:  # nothing of this layer resident: route as the target
            return indices, weights
        return restrict(indices, weights, allowed, self.experts_per_token)


def restrict(indices: torch.Tensor, weights: torch.Tensor, allowed: torch.Tensor, keep_top: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """indices, weights [T, k] -> the same shapes with disallowed slots given weight 0 and pointed at an allowed
    expert the token already uses (or the first allowed one), the kept weights rescaled to the row's total."""
    keep = torch.isin(indices, allowed.to(indices.device))
    if keep_top is not None and keep_top < indices.shape[1]:
        ranked = torch.where(keep, weights.float(), torch.full_like(weights, -1.0, dtype=torch.float32))
        top = ranked.topk(keep_top, dim=-1).indices
        keep = keep & torch.zeros_like(keep).scatter_(1, top, True)
    kept = torch.where(keep, weights, torch.zeros_like(weights))
    total, part = weights.sum(-1, keepdim=True), kept.sum(-1, keepdim=True)
    scaled = torch.where(part > 0, kept * (total / part.clamp_min(1e-20)), kept)
    first_kept = indices.gather(1, keep.to(torch.int8).argmax(-1, keepdim=True))
    fill = torch.where(keep.any(-1, keepdim=True), first_kept, allowed[0].to(indices.device).expand_as(first_kept))
    return torch.where(keep, indices, fill), scaled.to(weights.dtype)


class SelfDrafter:
    name = "self"
    needs_hidden = False

    def __init__(self, model: CausalLM, cache: Any, resident: Callable[[], set] | None,
                 experts_per_token: int | None = None):
        self.cache = cache
        self.resident = resident
        self.experts_per_token = experts_per_token
        self.model = model.view(VIEW, RestrictedRouting)  # built once per target, kept across requests
        self.routing: RestrictedRouting = self.model.ops

    def rewind(self, n: int) -> None:
        pass  # drafts live in the target's cache only during propose

    @torch.inference_mode()
    def propose(self, context: Sequence[int], state: TargetState, budget: DraftBudget) -> DraftTree:
        resident = self.resident() if self.resident is not None else None
        self.routing.experts_per_token = self.experts_per_token  # the view is shared: this request's settings
        self.routing.allowed = None if resident is None else _by_layer(resident)
        self.routing.wanted = {}
        cap = budget.node_cap
        L = self.cache.length
        depth = min(budget.depth, getattr(self.cache, "capacity", L + budget.depth) - L)
        cands, q_rows, sampled, token = [], [], False, int(context[-1])
        try:
            for j in range(1, depth + 1):
                ids = torch.tensor([token], dtype=torch.long, device=self.model.device)
                logits = self.model.forward(ids, self.cache, last_only=True)[-1]
                tokens, q, sampled = top_candidates(logits, state, budget.width)
                cands.append(tokens)
                q_rows.append(q)
                token = tokens[0]
                if sum(map(len, cands)) >= cap:
                    break
        finally:
            self.cache.trim(self.cache.length - L)
        tree = chain_with_siblings(cands, q_rows if sampled else None, sampled).prune(cap)
        tree.expert_hints = [UnitKey(layer, "expert", e) for layer, es in sorted(self.routing.wanted.items())
                             for e in sorted(es) if resident is None or UnitKey(layer, "expert", e) not in resident]
        return tree


def _by_layer(keys: set) -> dict[int, torch.Tensor]:
    out: dict[int, list[int]] = {}
    for k in keys:
        if k.kind == "expert":
            out.setdefault(k.layer, []).append(k.expert)
    return {layer: torch.tensor(sorted(es), dtype=torch.long) for layer, es in out.items()}
