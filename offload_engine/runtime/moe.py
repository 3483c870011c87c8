"""Routed-expert compute: tokens grouped by expert, only routed experts touched.

Experts may arrive in any order (resident ones first, the rest as reads land); each expert's contribution is
kept and the sum is formed in ascending expert order, so the result is bitwise independent of arrival order
and therefore of placement and prefetch timing.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from .kernels.int_experts import IntExpert

ExpertFn = Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]


# Decode (one token) takes a short path with the same arithmetic: the token's row is the whole input and each
# routed expert's slot is found in a Python list, so a step saves ~6 tiny torch ops per expert (96 experts per
# token on the bench model, ~5 us each) without changing a bit of the result.
_ROW0 = torch.zeros(1, dtype=torch.long)

# A few rows (a draft tree's verification, an MTP layer catching up on a step's tokens) read their routing into
# Python once (RowRouting): each expert's rows then come as views where they are consecutive, instead of a
# torch.where, two gathers and a scatter per expert (on CUDA, torch.where also waits for the device each time).
# On the bundled demo model that was 1.6 ms of a 2-token verification's 8.4 (tools/spec_profile.py).
SMALL_ROWS = 16
Rows = torch.Tensor | slice  # the rows an expert's part belongs to: an index tensor, or consecutive rows


class RowRouting:
    """The routing of a few rows, read once: `order` (routed_experts' order) and each expert's (row, slot) pairs."""

    def __init__(self, indices: torch.Tensor, weights: torch.Tensor):
        self.pairs: dict[int, list[tuple[int, int]]] = {}
        last: dict[int, tuple[int, float, int]] = {}
        for t, (row, ws) in enumerate(zip(indices.tolist(), weights.float().tolist())):
            for s, (e, w) in enumerate(zip(row, ws)):
                self.pairs.setdefault(e, []).append((t, s))
                last[e] = (t, w, e)
        # routed_experts' order: by the last row routed to each expert, then its weight there, then its index
        self.order = sorted(last, key=last.__getitem__)

    def rows_of(self, expert: int, x: torch.Tensor, weights: torch.Tensor
                ) -> tuple[Rows, torch.Tensor, torch.Tensor]:
        """(rows, x's rows [n, H], their routing weights [n] in x's dtype) of one expert: views where the rows are
        consecutive and (beyond one row) share a slot, else the gathers of the general path (the same values)."""
        pairs = self.pairs[expert]
        first, n = pairs[0][0], len(pairs)
        slots = {s for _, s in pairs}
        if pairs[-1][0] - first == n - 1 and len(slots) == 1:
            rows = slice(first, first + n)
            s = pairs[0][1]
            return rows, x[rows], weights[rows, s].to(x.dtype)
        tok = torch.tensor([t for t, _ in pairs], device=x.device)
        slot = torch.tensor([s for _, s in pairs], device=x.device)
        return tok, x[tok], weights[tok, slot].to(x.dtype)


def routed_experts(indices: torch.Tensor, weights: torch.Tensor) -> list[int]:
    """The experts routed to, in the order a token-by-token pass would last have used them: by the last token
    routed to each, then by its routing weight there (the heaviest last). The store stamps recency in this order
    (TieredStore.acquire), so after a prefill the cache keeps the experts of the prompt's last tokens, those the
    first decode steps are likeliest to reuse, instead of whichever reads landed last: on the bench model that
    is 36 -> 16 misses on the first decode step and 13.4 -> 11.4 misses per token over 16 (docs/PERF.md)."""
    if indices.shape[0] == 1:
        order = sorted(zip(weights[0].float().tolist(), indices[0].tolist()))
        return list(dict.fromkeys(e for _, e in order))  # an expert listed twice (never in top-k) kept once
    if indices.shape[0] <= SMALL_ROWS:
        return RowRouting(indices, weights).order
    # a prefill: vectorized (a Python loop over 4096 tokens x 8 experts costs ~10 ms per layer)
    flat, w = indices.reshape(-1), weights.reshape(-1).float()
    position = torch.arange(indices.shape[0], device=indices.device).repeat_interleave(indices.shape[1])
    last = torch.full((int(flat.max()) + 1,), -1, dtype=position.dtype, device=flat.device)
    last.scatter_reduce_(0, flat, position, "amax")
    at_last = position == last[flat]
    weight = torch.zeros(last.shape, dtype=w.dtype, device=w.device).scatter_(0, flat[at_last], w[at_last])
    experts = torch.nonzero(last >= 0).flatten()
    experts = experts[torch.argsort(weight[experts], stable=True)]  # then by last position, keeping weight order
    return experts[torch.argsort(last[experts], stable=True)].tolist()


def expert_part(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, expert: int,
                w: Mapping[str, torch.Tensor], expert_fn: ExpertFn, routing: RowRouting | None = None
                ) -> tuple[Rows, torch.Tensor]:
    """One expert's weighted output for the tokens routed to it: (token rows, [n, H]). routing: the rows'
    RowRouting where there are a few (the same bits, fewer ops)."""
    if x.shape[0] == 1:
        slot = indices[0].tolist().index(expert)
        return _ROW0, expert_fn(w, x.contiguous()) * weights[:, slot:slot + 1].to(x.dtype)
    if routing is not None:
        tok, xs, ws = routing.rows_of(expert, x, weights)
        return tok, expert_fn(w, xs.contiguous()) * ws[:, None]
    tok, slot = torch.where(indices == expert)
    return tok, expert_fn(w, x[tok]) * weights[tok, slot, None].to(x.dtype)


def native_parts(kernels, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 experts: list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
                 routing: RowRouting | None = None) -> dict[int, tuple[Rows, torch.Tensor]]:
    """expert_part for several experts in one native call per kind (kernels: a kernels.decode.DecodeKernels):
    experts lists (expert, its plain (gate, up, down) or its int kernel forms: kernels.int_experts.IntExpert). Each
    expert's part is the same bits computed alone or with others."""
    xs, ws, rows = [], [], []
    if x.shape[0] == 1:
        routed = indices[0].tolist()
        row = weights[0].to(x.dtype).unbind(0)  # one op for the k routing weights (0-d views: one value each)
        for e, _ in experts:
            xs.append(x)
            ws.append(row[routed.index(e)])
            rows.append(_ROW0)
    else:
        for e, _ in experts:
            if routing is not None:
                tok, xe, we = routing.rows_of(e, x, weights)
                xe, we = xe.contiguous(), we.contiguous()
            else:
                tok, slot = torch.where(indices == e)
                xe, we = x[tok], weights[tok, slot].to(x.dtype)
            xs.append(xe)
            ws.append(we)
            rows.append(tok)
    out = {}
    for quantized in (False, True):
        chosen = [i for i, (_, m) in enumerate(experts) if isinstance(m, IntExpert) == quantized]
        if not chosen:
            continue
        mats = [experts[i][1] for i in chosen]
        run = kernels.module.experts_int if quantized else kernels.module.experts
        ys = run([xs[i] for i in chosen], [m[0] for m in mats], [m[1] for m in mats], [m[2] for m in mats],
                 [ws[i] for i in chosen])
        out.update({experts[i][0]: (rows[i], y) for i, y in zip(chosen, ys)})
    return out


def combine(x: torch.Tensor, parts: dict[int, tuple[Rows, torch.Tensor]]) -> torch.Tensor:
    """Sum the experts' parts in ascending expert order (arrival order must not change the bits)."""
    out = torch.zeros_like(x)
    for e in sorted(parts):
        tok, y = parts[e]
        if x.shape[0] == 1:  # the one row: the same elementwise additions as below
            out.add_(y)
        elif isinstance(tok, slice):  # consecutive rows (RowRouting): the same additions on a view
            out[tok].add_(y)
        else:
            # a token appears once per expert, so this equals index_add_ bit for bit, without its parallel region
            # (which costs milliseconds per call on a contended CPU for a single decode row)
            out[tok] += y
    return out


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE routing: softmax over all experts in fp32, top-k, optional renormalization."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return idx, top.to(logits.dtype)

