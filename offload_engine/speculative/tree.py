"""Draft trees: what a drafter proposes, and how one target forward verifies all of it.

Glossary:
  root      the last accepted token; it is not in the target's KV cache yet and is forwarded with the tree
  node      one drafted token; `parents[i]` is the node it continues (-1: the root). Nodes are stored in
            topological order (a parent before its children), so ancestors always have smaller indices and
            a root-to-node path is ascending (what `KVCache.keep` needs)
  siblings  nodes with the same parent, tried by the verifier in index order
  q         the draft distribution a node was drawn from (after the sampling warpers), when the drafter has
            one; `sampled[i]` says whether node i was *drawn* from q[i] (ratio test) or chosen
            deterministically (n-gram, top-k alternatives: accepted with the target probability)

Flattening (`tree_inputs`): the verification forward gets [root] + nodes as T = 1 + N tokens, position ids
prefix length + depth, and a boolean mask [T, cache.length + T] in which every token sees the whole prefix
and, inside the tree, only its ancestors and itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # [N]
    parents: list[int] = field(default_factory=list)  # [N], -1 = root
    q: torch.Tensor | None = None  # [N, V] float32 draft distributions, or None (deterministic drafter)
    sampled: list[bool] = field(default_factory=list)  # [N] drawn from q[i] (True) or chosen (False)
    expert_hints: list = field(default_factory=list)  # UnitKeys the drafter expects the verification to route to
    _rows: list[torch.Tensor] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.sampled:
            self.sampled = [False] * len(self.tokens)
        if not (len(self.tokens) == len(self.parents) == len(self.sampled)):
            raise ValueError("DraftTree: tokens, parents and sampled must have the same length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"DraftTree: node {i} has parent {p}; parents must precede their children")
        if self.q is not None and self.q.shape[0] != len(self.tokens):
            raise ValueError(f"DraftTree: q has {self.q.shape[0]} rows for {len(self.tokens)} nodes")
        if any(self.sampled) and self.q is None:
            raise ValueError("DraftTree: sampled nodes need their draft distribution q")

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, q_row: torch.Tensor | None = None, sampled: bool = False) -> int:
        """Append a node (its parent must exist already); returns its index. q rows are stacked later."""
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} does not exist")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.sampled.append(sampled)
        if q_row is not None:
            self._rows.append(q_row)
        return len(self.tokens) - 1

    def finalize(self) -> "DraftTree":
        """Stack q rows given to `add` (every node must then have one)."""
        if self._rows:
            if len(self._rows) != len(self.tokens):
                raise ValueError("DraftTree.finalize: give a q row for every node or for none")
            self.q = torch.stack(self._rows)
            self._rows = []
        self.__post_init__()
        return self

    def depths(self) -> list[int]:
        """Depth of each node: children of the root have depth 1."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1: the root) in the order the verifier tries them."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`, ascending."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def prune(self, max_nodes: int) -> "DraftTree":
        """The first `max_nodes` nodes (a prefix of a topological order is still a tree)."""
        if len(self) <= max_nodes:
            return self
        n = max(0, max_nodes)
        return DraftTree(self.tokens[:n], self.parents[:n], None if self.q is None else self.q[:n],
                         self.sampled[:n], self.expert_hints)


def tree_inputs(tree: DraftTree, root: int, prefix: int, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [T], positions [T] and mask [T, prefix + T] for one forward over [root] + tree (T = 1 + N).

    `prefix` is the number of positions already in the cache (the root's position)."""
    n = len(tree)
    tokens = torch.tensor([root] + tree.tokens, dtype=torch.long, device=device)
    depth = torch.tensor([0] + tree.depths(), dtype=torch.long, device=device)
    positions = prefix + depth
    # ancestor-or-self inside the tree: row i (0 = root) sees column j iff j is on i's path
    local = torch.zeros((n + 1, n + 1), dtype=torch.bool)
    local[:, 0] = True
    local[0, 0] = True
    for i, p in enumerate(tree.parents, start=1):
        if p >= 0:
            local[i] = local[p + 1]
        local[i, i] = True
    mask = torch.cat([torch.ones((n + 1, prefix), dtype=torch.bool), local], dim=1).to(device)
    return tokens, positions, mask


def chain_with_siblings(candidates: list[list[int]], q_rows: list[torch.Tensor] | None = None,
                        sampled_first: bool = False) -> DraftTree:
    """The common drafter shape: a main chain (candidates[d][0] at depth d+1) with alternative tokens
    (candidates[d][1:]) as leaves beside each chain node.

    q_rows[d] is the draft distribution at depth d+1 (shared by the chain node and its siblings);
    sampled_first: the chain node was drawn from it (the siblings are always deterministic choices)."""
    tree = DraftTree()
    parent = -1
    for d, cands in enumerate(candidates):
        if not cands:
            break
        q = q_rows[d] if q_rows is not None else None
        main = tree.add(cands[0], parent, q, sampled=sampled_first)
        for tok in cands[1:]:
            tree.add(tok, parent, q, sampled=False)
        parent = main
    return tree.finalize()
