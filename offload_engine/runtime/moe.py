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


def routed_experts(indices: torch.Tensor, weights: torch.Tensor) -> list[int]:
    """The experts routed to, in the order a token-by-token pass would last have used them: by the last token
    routed to each, then by its routing weight there (the heaviest last). The store stamps recency in this order
    (TieredStore.acquire), so after a prefill the cache keeps the experts of the prompt's last tokens, those the
    first decode steps are likeliest to reuse, instead of whichever reads landed last: on the bench model that
    is 36 -> 16 misses on the first decode step and 13.4 -> 11.4 misses per token over 16 (docs/PERF.md)."""
    if indices.shape[0] == 1:
        order = sorted(zip(weights[0].float().tolist(), indices[0].tolist()))
        return list(dict.fromkeys(e for _, e in order))  # an expert listed twice (never in top-k) kept once
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
                w: Mapping[str, torch.Tensor], expert_fn: ExpertFn) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's weighted output for the tokens routed to it: (token rows, [n, H])."""
    if x.shape[0] == 1:
        slot = indices[0].tolist().index(expert)
        return _ROW0, expert_fn(w, x.contiguous()) * weights[:, slot:slot + 1].to(x.dtype)
    tok, slot = torch.where(indices == expert)
    return tok, expert_fn(w, x[tok]) * weights[tok, slot, None].to(x.dtype)


def native_parts(kernels, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 experts: list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
                 ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
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
            tok, slot = torch.where(indices == e)
            xs.append(x[tok])
            ws.append(weights[tok, slot].to(x.dtype))
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


def combine(x: torch.Tensor, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sum the experts' parts in ascending expert order (arrival order must not change the bits)."""
    out = torch.zeros_like(x)
    for e in sorted(parts):
        tok, y = parts[e]
        if x.shape[0] == 1:  # the one row: the same elementwise additions as below
            out.add_(y)
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

