"""Verification of a draft tree against the target's logits: pure tensor functions.

Greedy: walk down from the root, at each node taking the child whose token equals the target's argmax
(siblings in order); the first node without such a child contributes the target's argmax as the correction
(or, at a leaf, the bonus) token.

Sampling (exact; Leviathan et al. / Chen et al., with SpecInfer's multi-candidate extension): at a node with
target distribution p, the children are tried in order:
  - a child x *drawn* from the draft distribution q: accept with min(1, p(x) / q(x)); on rejection
    p <- normalize(max(0, p - q)) (the residual)
  - a child x *chosen* deterministically (n-gram, top-k alternatives): accept with p(x); on rejection
    p <- p with x zeroed, renormalized
An accepted child becomes the next node; when every child is rejected, or at a leaf, one token is drawn
from the current p. Each output token is then distributed exactly as the target's p, whatever the drafts.
p and q are the post-temperature / top-k / top-p / min-p distributions (`sampling.probabilities`).

`node_step` is the per-node rule, vectorized over a leading batch dimension so that tests can check the
output distribution on many draws; `verify` applies it along a tree with a batch of one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..generate.sampling import SamplingParams, probabilities
from .tree import DraftTree

_TINY = 1e-30


@dataclass
class Verdict:
    nodes: list[int]  # accepted nodes, root's child first
    tokens: list[int]  # the accepted nodes' tokens, then the correction / bonus token: len(nodes) + 1
    ranks: list[int] = field(default_factory=list)  # per depth visited: sibling rank accepted, -1 = none

    @property
    def accepted(self) -> int:
        return len(self.nodes)


def _normalize(p: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = p.sum(dim=-1, keepdim=True)
    return torch.where(total > _TINY, p / total.clamp_min(_TINY), fallback)


def node_step(p: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None, sampled: list[bool],
              u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One node's acceptance test over its K children, for B independent draws.

    p [B, V] target distribution; tokens [B, K] children's tokens; q [B, K, V] their draft distributions
    (rows of chosen children are ignored; None when no child was drawn); sampled [K]; u [B, K] uniforms.
    Returns (choice [B]: the accepted child's index or -1, p [B, V]: the distribution to draw from when
    choice is -1)."""
    B, K = tokens.shape
    choice = torch.full((B,), -1, dtype=torch.long, device=p.device)
    rows = torch.arange(B, device=p.device)
    for k in range(K):
        open_ = choice < 0
        x = tokens[:, k]
        px = p[rows, x]
        if sampled[k]:
            qk = q[:, k]
            accept = open_ & (u[:, k] * qk[rows, x] < px)  # u < p/q without dividing by a tiny q
            residual = _normalize((p - qk).clamp_min(0.0), p)
        else:
            accept = open_ & (u[:, k] < px)
            residual = _normalize(p.scatter(1, x[:, None], 0.0), p)
        choice = torch.where(accept, torch.full_like(choice, k), choice)
        reject = (open_ & ~accept)[:, None]
        p = torch.where(reject, residual, p)
    return choice, p


def verify(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> Verdict:
    """target_logits [1 + N, V]: row 0 scores the token after the root, row 1 + i the token after node i."""
    if target_logits.shape[0] != len(tree) + 1:
        raise ValueError(f"verify: {target_logits.shape[0]} logit rows for a tree of {len(tree)} nodes (+ root)")
    kids: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents):
        kids.setdefault(parent, []).append(i)
    if params.greedy:
        return _verify_greedy(tree, target_logits, kids)
    probs = probabilities(target_logits, params)
    nodes, ranks, node = [], [], -1
    while True:
        p = probs[node + 1][None]
        children = kids.get(node, [])
        if not children:
            break
        tokens = torch.tensor([[tree.tokens[c] for c in children]], device=p.device)
        q = tree.q[children][None].to(p.device) if tree.q is not None else None
        u = torch.rand((1, len(children)), generator=generator, device=_gen_device(generator)).to(p.device)
        choice, p = node_step(p, tokens, q, [tree.sampled[c] for c in children], u)
        k = int(choice[0])
        ranks.append(k)
        if k < 0:
            break
        node = children[k]
        nodes.append(node)
    last = int(torch.multinomial(p[0].to(_gen_device(generator)), 1, generator=generator))
    return Verdict(nodes, [tree.tokens[n] for n in nodes] + [last], ranks)


def _verify_greedy(tree: DraftTree, logits: torch.Tensor, kids: dict[int, list[int]]) -> Verdict:
    best = logits.argmax(dim=-1).tolist()  # lowest id on ties, as Sampler.sample
    nodes, ranks, node = [], [], -1
    while True:
        children = kids.get(node, [])
        if not children:
            break
        want = best[node + 1]
        k = next((r for r, c in enumerate(children) if tree.tokens[c] == want), -1)
        ranks.append(k)
        if k < 0:
            break
        node = children[k]
        nodes.append(node)
    return Verdict(nodes, [tree.tokens[n] for n in nodes] + [best[node + 1]], ranks)


def _gen_device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")
