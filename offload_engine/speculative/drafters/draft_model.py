"""Drafting with a second, smaller checkpoint that shares the target's tokenizer (--draft-model DIR).

The draft model has its own KV cache (and, opened by the caller, its own store and budget). Its cache holds a
prefix of the committed context followed by the previous step's drafts; each proposal trims it back to the
longest prefix it shares with the context, forwards the rest (the newly committed tokens and the root) in one
pass, then drafts a chain one token at a time, with the next most likely tokens as siblings at each depth.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ...errors import ConfigError
from ...runtime.kv_cache import KVCache
from ..tree import DraftTree, chain_with_siblings
from . import DraftBudget, TargetState, top_candidates


def check_same_vocabulary(target_tokenizer: Any, draft_tokenizer: Any, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft model whose token ids mean something else than the target's."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        a, b = target_tokenizer.backend.get_vocab(), draft_tokenizer.backend.get_vocab()
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
            raise ConfigError(f"--draft-model: its vocabulary differs from the target's ({len(b)} vs {len(a)} "
                              f"tokens; e.g. {', '.join(f'{t!r}={i}' for t, i in diff)}): speculative decoding "
                              f"needs the same tokenizer")
        if target_tokenizer.eos_token_ids != draft_tokenizer.eos_token_ids:
            raise ConfigError(f"--draft-model: end-of-sequence ids differ ({sorted(draft_tokenizer.eos_token_ids)} "
                              f"vs the target's {sorted(target_tokenizer.eos_token_ids)})")
    elif target_vocab != draft_vocab:
        raise ConfigError(f"--draft-model: vocab_size {draft_vocab} differs from the target's {target_vocab} "
                          f"(and no tokenizer.json to compare): speculative decoding needs the same tokenizer")


class DraftModelDrafter:
    name = "draft"
    needs_hidden = False

    def __init__(self, draft_model: Any, capacity: int, target_vocab: int):
        self.model = draft_model
        self.cache = KVCache(draft_model.num_layers, capacity, draft_model.device, kv_dtype=draft_model.kv_dtype)
        self.ids: list[int] = []  # what self.cache holds
        self.target_vocab = target_vocab

    def rewind(self, n: int) -> None:
        pass  # resynchronized against the context on the next propose

    @torch.inference_mode()
    def propose(self, context: Sequence[int], state: TargetState, budget: DraftBudget) -> DraftTree:
        same = 0
        limit = min(len(self.ids), len(context) - 1)  # the root is always forwarded: its logits draft depth 1
        while same < limit and self.ids[same] == context[same]:
            same += 1
        self.cache.trim(len(self.ids) - same)
        del self.ids[same:]
        cap = budget.node_cap
        room = self.cache.capacity - len(context)  # positions for drafted tokens after the context
        depth = max(0, min(budget.depth, room + 1))
        logits = self._forward([int(t) for t in context[same:]])
        cands, q_rows, sampled = [], [], False
        for j in range(1, depth + 1):
            tokens, q, sampled = top_candidates(logits, state, budget.width)
            cands.append(tokens)
            q_rows.append(q)
            if j == depth or sum(map(len, cands)) >= cap:
                break
            logits = self._forward([tokens[0]])
        return chain_with_siblings(cands, q_rows if sampled else None, sampled).prune(cap)

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.model.device)
        logits = self.model.forward(ids, self.cache, last_only=True)[-1]
        self.ids.extend(tokens)
        V = self.target_vocab
        if logits.shape[-1] > V:  # padded embedding rows beyond the shared tokenizer: never drafted
            logits = logits[:V]
        elif logits.shape[-1] < V:
            logits = torch.cat([logits, logits.new_full((V - logits.shape[-1],), float("-inf"))])
        return logits
