"""The speculative Stepper: draft a tree, verify it with one target forward, keep the accepted path.

One step (the root is the last accepted token, not yet in the target's cache, at position L = cache.length):
  1. the cost model picks (drafter, depth, width), or a plain step when speculation would lose
  2. the drafter proposes a DraftTree of at most the room left in the cache
  3. one target forward over [root] + tree (tree.tree_inputs: ancestor-only mask, positions L + depth); the
     MoE layers gather the experts of all T tokens per layer and acquire each once
  4. verifier.verify picks the accepted path and the correction / bonus token
  5. KVCache.keep([L] + path) drops the rejected branches' entries: the cache then holds exactly the
     committed tokens, the new last token excepted (as after a plain step)
`finish(unused)` trims the entries of returned tokens the decode loop did not emit, so the cache ends where
plain decoding would have left it.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from ..config import MAX_DEPTH, MAX_WIDTH, check_spec
from ..errors import ConfigError
from ..generate.decoder import PlainStepper
from ..generate.sampling import Sampler
from .chooser import CostModel, DraftChoice, SpecStats
from .drafters import DraftBudget, Drafter, TargetState
from .tree import DraftTree, tree_inputs
from .verifier import verify


class SpeculativeStepper:
    def __init__(self, model: Any, cache: Any, sampler: Sampler, drafters: Sequence[Drafter], *,
                 depth: int | None = None, width: int | None = None, max_depth: int = MAX_DEPTH,
                 max_width: int = MAX_WIDTH, cost: CostModel | None = None, stats: SpecStats | None = None,
                 store: Any = None):
        if not drafters:
            raise ConfigError("speculative decoding needs at least one drafter")
        for name, v in (("spec_depth", depth), ("spec_width", width)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        self.model, self.cache, self.sampler = model, cache, sampler
        self.drafters = {d.name: d for d in drafters}
        self.depth, self.width = depth, width
        self.max_depth, self.max_width = max(max_depth, depth or 0), max(max_width, width or 0)
        if not getattr(getattr(model, "ops", None), "supports_trees", True):  # recurrent layers: chains only
            self.max_width, self.width = 1, 1 if width is not None else None
        spec = getattr(model, "spec", None)
        seeded = not sampler.params.greedy and sampler.params.seed is not None
        experts, per_token = getattr(spec, "num_experts", 0) or 0, getattr(spec, "num_experts_per_tok", 0) or 0
        self.cost = cost or CostModel(experts, per_token, timed=not seeded)
        self.stats = stats if stats is not None else SpecStats()
        self.store = store
        self.state = TargetState(sampler.params, sampler.generator,
                                 keep_hidden=any(d.needs_hidden for d in drafters))
        self.context: list[int] = []
        self._device = getattr(model, "device", None)
        self._shadow: tuple[str, DraftTree, int, list[int], list[int]] | None = None  # n-gram scoring

    # ---- Stepper protocol ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> list[int]:
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self._device)
        logits, hidden, seconds = self._forward(ids, None, None, last_only=not self.state.keep_hidden)
        self.cost.observe_forward(len(prompt_ids), seconds)
        token = self.sampler.sample(logits[-1])
        if hidden is not None:
            self.state.push_hidden(0, hidden)
        self.context = [int(t) for t in prompt_ids] + [token]
        if getattr(self.cache, "state_nbytes", 0):  # recurrent state in the cache (KVCache.keep: chains only)
            self.max_width, self.width = 1, 1 if self.width is not None else None
        return [token]

    @torch.inference_mode()  # the cache's tensors are inference tensors: keep() updates them in place
    def step(self, last_token: int) -> list[int]:
        if not self.context or self.context[-1] != last_token:
            raise RuntimeError("SpeculativeStepper.step: last_token is not the last token this stepper returned")
        self.stats.steps += 1
        start = time.perf_counter()
        room = getattr(self.cache, "capacity", 1 << 30) - self.cache.length - 1  # nodes that fit after the root
        plan = self._plan()
        out = None
        if plan.drafter is not None and room >= 1:
            tree, drafter, depth = self._propose(plan, room)
            if len(tree):
                self._shadow = None
                out = self._verify(tree, drafter, plan)
        if out is None:
            out = self._plain(last_token)
        self.cost.observe_step(time.perf_counter() - start, plan, len(out))
        return out

    @torch.inference_mode()
    def finish(self, unused: int) -> None:
        if unused:
            self.cache.trim(unused)
            del self.context[len(self.context) - unused:]
            for d in self.drafters.values():
                d.rewind(unused)

    # ---- steps -----------------------------------------------------------------------------------------
    def _plan(self) -> DraftChoice:
        if self.cost.keep_plain():
            return DraftChoice(None)
        priors = {name: self._draft_prior(name) for name in self.drafters}
        shadow = {n for n, d in self.drafters.items() if getattr(d, "free", False)}
        # a drafter with layers of its own to catch up (MTP after plain steps) first runs them over the positions
        # it missed: about one target layer's share of a forward over those positions
        layers = max(getattr(self.model, "num_layers", 1), 1)
        catch_up = {n: self.cost.forward_time(k) / layers for n, d in self.drafters.items()
                    if (k := getattr(d, "pending", lambda n: 0)(len(self.context))) > 0}
        start = time.perf_counter()
        plan = self.cost.plan(priors, self.max_depth, self.max_width, self.depth, self.width, shadow, catch_up)
        self.cost.observe_planning(time.perf_counter() - start)
        return plan

    def _draft_prior(self, name: str) -> float:
        """Seconds per depth of drafting before any is timed: a fraction of a target forward."""
        share = {"ngram": 0.0, "mtp": 0.1, "draft": 0.3, "self": 1.0}.get(name, 0.5)
        return share * self.cost.forward_time(1)

    def _propose(self, plan: DraftChoice, room: int) -> tuple[DraftTree, Drafter, int]:
        drafter = self.drafters[plan.drafter]
        depth = min(plan.depth, room)
        budget = DraftBudget(depth, plan.width, max_nodes=room)
        start = time.perf_counter()
        tree = drafter.propose(self.context, self.state, budget).prune(room)
        seconds = time.perf_counter() - start
        self.stats.draft_s += seconds
        # a drafter's one-off catch-up (MTP syncing positions drafted without it) is not its per-step price
        self.cost.observe_draft(drafter.name, depth, seconds - getattr(drafter, "catch_up_s", 0.0))
        return tree, drafter, depth

    def _plain(self, last_token: int) -> list[int]:
        self._shadow_propose()
        L = self.cache.length
        ids = torch.tensor([last_token], dtype=torch.long, device=self._device)
        logits, hidden, seconds = self._forward(ids, None, None, last_only=True)
        self.cost.observe_forward(1, seconds)
        token = self.sampler.sample(logits[-1])
        if hidden is not None:
            self.state.push_hidden(L, hidden)
        self.context.append(token)
        self._shadow_score(token)
        return [token]

    def _verify(self, tree: DraftTree, drafter: Drafter, plan: DraftChoice) -> list[int]:
        L = self.cache.length
        tokens, positions, mask = tree_inputs(tree, self.context[-1], L, device=self._device or "cpu")
        if self.store is not None and tree.expert_hints:
            self.store.prefetch(tree.expert_hints)
        logits, hidden, seconds = self._forward(tokens, positions, mask, last_only=False)
        self.stats.verify_s += seconds
        self.cost.observe_forward(tokens.shape[0], seconds)
        # bias, penalties, a grammar's mask: each row continues the accepted tokens along its own path (row 0: root)
        paths = [[]] + [[tree.tokens[n] for n in tree.path(i)] for i in range(len(tree))]
        verdict = verify(tree, self.sampler.adjust(logits, paths), self.sampler.params, self.sampler.generator)
        self.sampler.accept(verdict.tokens, logits[[0] + [1 + n for n in verdict.nodes]])
        self.cache.keep([L] + [L + 1 + n for n in verdict.nodes])
        if hidden is not None:
            rows = torch.tensor([0] + [1 + n for n in verdict.nodes], device=hidden.device)
            self.state.push_hidden(L, hidden.index_select(0, rows))
        self.context.extend(verdict.tokens)
        self.stats.record(drafter.name, len(tree), verdict.accepted)
        self.cost.observe_ranks(drafter.name, verdict.ranks, _widths(tree, verdict.nodes))
        return verdict.tokens

    def _forward(self, tokens: torch.Tensor, positions, mask, last_only: bool):
        start = time.perf_counter()
        keep = self.state.keep_hidden
        out = self.model.forward(tokens, self.cache, positions=positions, mask=mask,
                                 last_only=last_only and not keep, return_hidden=keep)
        seconds = time.perf_counter() - start
        self.stats.target_forwards += 1
        logits, hidden = out if keep else (out, None)
        return logits, hidden, seconds

    # ---- shadow scoring of free drafters (n-gram) during plain steps -----------------------------------
    def _shadow_propose(self) -> None:
        if self._shadow is not None:
            return
        free = [d for d in self.drafters.values() if getattr(d, "free", False)]
        if not free:
            return
        d = free[0]
        tree = d.propose(self.context, self.state, DraftBudget(self.max_depth, self.max_width))
        if len(tree):
            self._shadow = (d.name, tree, -1, [], [])

    def _shadow_score(self, token: int) -> None:
        if self._shadow is None:
            return
        name, tree, node, ranks, widths = self._shadow
        children = tree.children(node)
        rank = next((r for r, c in enumerate(children) if tree.tokens[c] == token), -1)
        ranks.append(rank)
        widths.append(len(children))
        if rank < 0 or not tree.children(children[rank]):
            self.cost.observe_ranks(name, ranks, widths)
            self._shadow = None
        else:
            self._shadow = (name, tree, children[rank], ranks, widths)


def _widths(tree: DraftTree, path: list[int]) -> list[int]:
    """Children offered at each node the verifier visited (the root, then each accepted node)."""
    out, node = [], -1
    for nxt in path + [None]:
        n = len(tree.children(node))
        if n == 0:
            break
        out.append(n)
        if nxt is None:
            break
        node = nxt
    return out


# ---------------------------------------------------------------------------------------------- factory

def make_stepper(model: Any, cache: Any, sampler: Sampler, spec: str = "auto", *, depth: int | None = None,
                 width: int | None = None, draft: Any = None, store: Any = None, stats: SpecStats | None = None,
                 tokenizer: Any = None, draft_tokenizer: Any = None, max_depth: int = MAX_DEPTH,
                 max_width: int = MAX_WIDTH, self_experts_per_token: int | None = None):
    """The Stepper for `spec` (one of SPEC_MODES). "off" is the plain stepper; "auto" lets the cost model pick
    among every drafter this model supports (n-gram; MTP when the checkpoint ships MTP layers; the draft model
    when given; self when the model has routed experts and a store); a named drafter is used alone, with the
    cost model choosing depth, width and whether to speculate at all unless depth and width are given.

    draft: the draft model (a CausalLM, or anything with `.model`), opened by the caller with its own budget;
    tokenizer / draft_tokenizer: checked for identical vocabularies when both are given;
    self_experts_per_token: the self drafter keeps at most this many of a token's (resident) experts."""
    # Engine.prepare checked the request's mode, but tools/ and tests call make_stepper directly: a mode outside
    # SPEC_MODES would otherwise build no drafter at all and decode plainly in silence
    check_spec(spec)
    if spec == "off":
        return PlainStepper(model, cache, sampler)
    from .drafters.factory import build_drafters

    # A seeded sampling run must reproduce: "auto" then leaves out the self drafter, whose drafts depend on
    # which experts happen to be resident (the cost model likewise stops using wall-clock times).
    seeded = not sampler.params.greedy and sampler.params.seed is not None
    drafters = build_drafters(spec, model, cache, draft=draft, store=store, tokenizer=tokenizer,
                              draft_tokenizer=draft_tokenizer, max_depth=max(max_depth, depth or 0),
                              with_self=not (seeded and spec == "auto"), self_experts_per_token=self_experts_per_token)
    return SpeculativeStepper(model, cache, sampler, drafters, depth=depth, width=width, max_depth=max_depth,
                              max_width=max_width, stats=stats, store=store)
