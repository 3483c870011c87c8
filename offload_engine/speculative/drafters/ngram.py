"""Prompt / context lookup: continue the last n tokens the way they continued earlier in the context.

For n from `max_n` down to `min_n`, every earlier occurrence of the context's last n tokens (most recent
first) proposes the tokens that followed it; distinct continuations are merged into a trie (shared prefixes
share nodes), at most `width` of them, each at most `depth` long. Drafts are deterministic (no q): the
verifier accepts a node with the target probability of its token.
"""
from __future__ import annotations

from typing import Sequence

from ..tree import DraftTree
from . import DraftBudget, TargetState


class NgramDrafter:
    name = "ngram"
    free = True  # proposals cost nothing: scored in the shadow of plain steps (cost.py)
    needs_hidden = False

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._ids: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions right after it, ascending

    def rewind(self, n: int) -> None:
        pass  # the index resynchronizes against the context on the next propose

    def propose(self, context: Sequence[int], state: TargetState, budget: DraftBudget) -> DraftTree:
        self._sync(context)
        cap = budget.node_cap
        conts = self._continuations(budget.depth, budget.width)
        tree = DraftTree()
        trie: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for cont in conts:
            parent = -1
            for tok in cont:
                node = trie.get((parent, tok))
                if node is None:
                    if len(tree) >= cap:
                        break
                    node = trie[(parent, tok)] = tree.add(tok, parent)
                parent = node
        return tree.finalize()

    def _continuations(self, depth: int, width: int) -> list[list[int]]:
        ids, out, seen = self._ids, [], set()
        end = len(ids)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            for start in reversed(self._index.get(tuple(ids[end - n:]), ())):
                if start >= end:
                    continue  # the suffix itself
                cont = tuple(ids[start:start + depth])
                if not cont or any(c[:len(cont)] == cont for c in seen):
                    continue
                seen.add(cont)
                out.append(list(cont))
                if len(out) >= width:
                    return out
        return out

    def _sync(self, context: Sequence[int]) -> None:
        ids = self._ids
        # the stepper's context only grows between proposals (a drafter serves one request): its length and the
        # last indexed token tell, without comparing the whole context on every step. A changed context can only
        # cost acceptance, never correctness: every draft is verified.
        if len(context) < len(ids) or (ids and context[len(ids) - 1] != ids[-1]):
            self._ids, self._index = [], {}
            ids = self._ids
        for tok in context[len(ids):]:
            ids.append(int(tok))
            j = len(ids)
            for n in range(self.min_n, self.max_n + 1):
                if j - n < 0:
                    break
                self._index.setdefault(tuple(ids[j - n:j]), []).append(j)
