"""Speculative decoding end to end: lossless greedy output for every drafter, depth and width, at 100% and 25%
budgets; draft == target accepts everything; seeded sampling is reproducible; the cache is rewound exactly."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from offload_engine import Budget, Engine
from offload_engine.errors import ConfigError
from offload_engine.speculative.chooser import BENCH_FIRST, REALIZED_WINDOW, REPLAN_EVERY, CostModel, DraftChoice
from offload_engine.generate.decoder import FinishEvent, GenerationState, PlainStepper, drive
from offload_engine.speculative.drafters.draft_model import check_same_vocabulary
from offload_engine.speculative.drafters.self_draft import restrict
from offload_engine.generate.sampling import Sampler, SamplingParams
from offload_engine.speculative.stepper import SpeculativeStepper, make_stepper
from offload_engine.tokenizer import Tokenizer

NEW = 64
PROMPTS = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The file is opened, read line by line, and each line is split on commas.",
    "import os\nimport sys\n",
)
DRAFTERS = ("ngram", "self", "draft", "mtp")


def open_engine(path, budget: Budget | None, max_context: int, spec: str = "auto") -> Engine:
    """spec="mtp" loads the checkpoint's MTP layers (as `mtp` units) whatever they cost; "auto" only when cheap."""
    return Engine.open(path, budget=budget, max_context=max_context, spec=spec)


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    """Engines by (model, budget): MoE targets at 25% (expert-heavy `offload` preset) and 100% (`tiny`)."""
    opened: dict[tuple[str, str], Engine] = {}

    def get(model: str, budget: str) -> Engine:
        key = (model, budget)
        if key not in opened:
            arch, options = {"qwen": ("qwen3_moe", {}), "deepseek": ("deepseek_v3", {"mtp": 1}),
                             "llama": ("llama", {})}[model]
            preset = "offload" if budget == "25%" else "tiny"
            path = checkpoint_factory(arch, preset, **options)
            opened[key] = open_engine(path, Budget(ram=budget) if model != "llama" else None, max_context=256,
                                      spec="mtp" if model == "deepseek" else "auto")
        return opened[key]

    yield get
    for e in opened.values():
        e.close()


def generate(engine: Engine, prompt: str, params: SamplingParams, spec: str = "off", depth=None, width=None,
             draft=None):
    ids = engine.encode(prompt)
    cache = engine.model.new_cache(len(ids) + params.max_new_tokens)
    stepper = make_stepper(engine.model, cache, Sampler(params), spec, depth=depth, width=width, draft=draft,
                           store=engine.store, tokenizer=engine.tokenizer,
                           draft_tokenizer=getattr(draft, "tokenizer", None))
    events = list(drive(stepper, ids, GenerationState(params, engine.tokenizer)))
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    return finish, stepper, cache


_reference: dict = {}


def plain(engine: Engine, prompt: str, params: SamplingParams):
    key = (str(engine.checkpoint.root), engine.placement.compute.budget, prompt, params)
    if key not in _reference:
        finish, _, cache = generate(engine, prompt, params)
        _reference[key] = (finish.token_ids, cache.length)
    return _reference[key]


def grid() -> list:
    """Every (depth 1..8, width 1..4) pair once across the four drafters. Each drafter's depth-1 case runs at a
    25% budget (the expert-heavy preset: every verification pass reads experts; widths 1-4 across drafters),
    the others at 100% (the tiny preset); prompts rotate."""
    cases = []
    for i, name in enumerate(DRAFTERS):
        for depth in range(1, 9):
            width = (depth + i) % 4 + 1
            budget = "25%" if depth == 1 else "100%"
            cases.append(pytest.param(name, depth, width, budget, depth % len(PROMPTS),
                                      id=f"{name}-d{depth}-w{width}"))
    return cases


@pytest.mark.parametrize("drafter, depth, width, budget, prompt", grid())
def test_greedy_output_is_identical_to_plain_decoding(engines, drafter, depth, width, budget, prompt):
    target = engines("deepseek" if drafter == "mtp" else "qwen", budget)
    draft = None
    if drafter == "draft":  # a different small model at 25%, the target itself at 100% (everything accepted)
        draft = engines("llama", "100%") if budget == "25%" else open_engine(target.checkpoint.root, None, 256)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    expected, length = plain(target, PROMPTS[prompt], params)
    finish, stepper, cache = generate(target, PROMPTS[prompt], params, drafter, depth, width, draft)
    assert finish.token_ids == expected
    assert cache.length == length  # the rewound cache holds what plain decoding's does
    assert stepper.stats.spec_steps > 0
    assert stepper.stats.target_forwards == 1 + stepper.stats.steps
    if draft is not None and draft is not engines("llama", "100%"):
        draft.close()


def test_hybrid_models_verify_chains(checkpoint_factory):
    """Recurrent (linear-attention) layers cannot keep a branch of a tree: the stepper sends chains, and the
    cache's recurrent state is rewound by replay; output stays identical."""
    target = open_engine(checkpoint_factory("qwen3_next", "tiny"), None, 256)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    expected, length = plain(target, PROMPTS[0], params)
    finish, stepper, cache = generate(target, PROMPTS[0], params, "self", 3, 3)
    assert finish.token_ids == expected and cache.length == length
    assert stepper.stats.accepted > 0 and stepper.max_width == 1
    target.close()


def test_draft_equal_to_target_accepts_everything(engines):
    target = engines("qwen", "100%")
    draft = open_engine(target.checkpoint.root, None, 256)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    for depth in (1, 3, 6):
        finish, stepper, _ = generate(target, PROMPTS[0], params, "draft", depth, 1, draft)
        assert finish.token_ids == plain(target, PROMPTS[0], params)[0]
        hist = stepper.stats.accept_hist
        # every step accepts all `depth` drafts (+ its bonus token), except where the cache's end cut the tree
        assert stepper.stats.accepted == stepper.stats.drafted
        assert hist[depth] >= stepper.stats.spec_steps - 1
        assert stepper.stats.target_forwards <= 1 + -(-(NEW - 1) // (depth + 1)) + 1
    draft.close()


def test_stopping_mid_step_rewinds_the_cache(engines):
    """A stop token inside an accepted run ends generation there; the unused ids' entries are trimmed."""
    target = engines("qwen", "100%")
    draft = open_engine(target.checkpoint.root, None, 256)
    expected, _ = plain(target, PROMPTS[1], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    stop = expected[9]
    for max_new in (NEW, 7):  # stop token, then length, cutting a 6-deep run of accepted drafts
        p = SamplingParams(max_new_tokens=max_new, ignore_eos=True, stop_token_ids=(stop,))
        want, length = plain(target, PROMPTS[1], p)
        finish, stepper, cache = generate(target, PROMPTS[1], p, "draft", 6, 1, draft)
        assert finish.token_ids == want and cache.length == length
    draft.close()


@pytest.mark.parametrize("spec", ["ngram", "draft", "mtp", "auto"])
def test_seeded_sampling_runs_are_reproducible(engines, spec):
    """Same seed, same output (the self drafter is left out: its drafts depend on what happens to be resident,
    which is why "auto" leaves it out of seeded sampling runs)."""
    target = engines("deepseek" if spec == "mtp" else "qwen", "100%")
    draft = engines("llama", "100%") if spec == "draft" else None
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1234, max_new_tokens=24, ignore_eos=True)
    depth, width = (None, None) if spec == "auto" else (3, 2)  # auto: the cost model decides, and is seeded too
    runs = [generate(target, PROMPTS[0], params, spec, depth, width, draft)[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 24
    other = SamplingParams(**{**params.__dict__, "seed": 99})
    assert generate(target, PROMPTS[0], other, spec, depth, width, draft)[0].token_ids != runs[0]


def test_cost_model_turns_speculation_off_when_it_loses_and_on_when_it_wins():
    cost = CostModel(num_experts=64, experts_per_token=4)
    cost.observe_forward(1, 0.010)
    cost.observe_forward(40, 0.140)  # a prefill: verification cost grows with the expert union
    for _ in range(20):
        cost.observe_ranks("ngram", [-1], [1])  # nothing is ever accepted
    assert cost.plan({"ngram": 0.0}, 8, 4, shadow={"ngram"}).drafter is None
    dense = CostModel()  # dense model: a forward over a few tokens costs about one token's
    for T in (1, 2, 5, 9):
        for _ in range(4):
            dense.observe_forward(T, 0.010 + 0.0002 * (T - 1))
    for _ in range(40):
        dense.observe_ranks("ngram", [0, 0, 0, -1], [1, 1, 1, 1])
    plan = dense.plan({"ngram": 0.0}, 8, 4, shadow={"ngram"})
    assert plan.drafter == "ngram" and plan.depth >= 3
    assert dense.plan({"ngram": 0.0}, 8, 4, depth=2, width=3) .depth == 2  # overrides win


def test_a_drafter_that_loses_in_seconds_is_benched_whatever_the_estimate_says():
    dense = CostModel()
    for T in (1, 2, 5, 9):
        for _ in range(4):
            dense.observe_forward(T, 0.010)
    for _ in range(40):
        dense.observe_ranks("ngram", [0, 0, -1], [1, 1, 1])
    plain, step = DraftChoice(None), dense.plan({"ngram": 0.0}, 8, 1, shadow={"ngram"})
    assert step.drafter == "ngram"
    for _ in range(4):
        dense.observe_step(0.010, plain)
    for _ in range(REALIZED_WINDOW):  # each speculative step emits 3 tokens but takes 4 plain steps' time
        dense.observe_step(0.040, step, tokens=3)
    assert dense.benched("ngram") and dense.plan({"ngram": 0.0}, 8, 1, shadow={"ngram"}).drafter is None
    for _ in range(BENCH_FIRST):
        dense.observe_step(0.010, plain)
    assert not dense.benched("ngram")
    for _ in range(REALIZED_WINDOW):  # now it pays: kept
        dense.observe_step(0.012, step, tokens=3)
    assert not dense.benched("ngram") and dense.plan({"ngram": 0.0}, 8, 1, shadow={"ngram"}).drafter == "ngram"


def test_a_clear_plain_verdict_stands_a_few_steps_until_an_accepted_token():
    cost = CostModel(num_experts=64, experts_per_token=4)
    cost.observe_forward(1, 0.010)
    cost.observe_forward(40, 0.140)
    for _ in range(20):
        cost.observe_ranks("ngram", [-1], [1])
    assert not cost.keep_plain()  # nothing planned yet
    assert cost.plan({"ngram": 0.0}, 8, 4, shadow={"ngram"}).drafter is None
    assert [cost.keep_plain() for _ in range(REPLAN_EVERY)] == [True] * (REPLAN_EVERY - 1) + [False]
    cost.plan({"ngram": 0.0}, 8, 4, shadow={"ngram"})
    cost.observe_ranks("ngram", [-1], [1])  # a rejection only lowers the rates: the verdict stands
    assert cost.keep_plain()
    cost.observe_ranks("ngram", [0, 0, 0], [1, 1, 1])  # accepted tokens: re-plan at once
    assert not cost.keep_plain()


def test_a_plain_verdict_with_nothing_to_probe_stands_past_the_probe_interval():
    """Past `probe_every` plain steps a plan looks for a drafter to probe; where none could win (here a drafter
    whose drafting costs a whole forward), the plain verdict stands REPLAN_EVERY steps like any clear one instead
    of every later step planning in full."""
    cost = CostModel(num_experts=64, experts_per_token=4, probe_every=4)
    cost.observe_forward(1, 0.010)
    cost.observe_forward(40, 0.140)
    drafters = {"self": 0.010}  # drafting costs a target forward: even 90% acceptance cannot pay
    plans = 0
    for _ in range(4 + 3 * REPLAN_EVERY):
        if cost.keep_plain():
            continue
        plans += 1
        assert cost.plan(drafters, 8, 1).drafter is None
    assert plans <= 3 + 3  # the probe interval's plans, then one per REPLAN_EVERY steps


def test_auto_is_lossless_and_reports_stats(engines):
    target = engines("deepseek", "25%")
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    finish, stepper, cache = generate(target, PROMPTS[0], params, "auto")
    assert finish.token_ids == plain(target, PROMPTS[0], params)[0]
    stats = stepper.stats.as_dict()
    assert {"mean_accepted", "accept_hist", "target_forwards"} <= set(stats)
    assert sorted(stepper.drafters) == ["mtp", "ngram", "self"]
    assert target.placement.home("mtp") == target.placement.compute.name  # MTP units pinned on the fastest tier


def test_refusals(engines):
    target = engines("qwen", "100%")
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ConfigError, match="no multi-token-prediction"):
        generate(target, PROMPTS[2], params, "mtp")
    with pytest.raises(ConfigError, match="needs a draft model"):
        generate(target, PROMPTS[2], params, "draft")
    with pytest.raises(ConfigError, match="spec must be one of"):
        generate(target, PROMPTS[2], params, "medusa")
    with pytest.raises(ConfigError, match="spec_depth"):
        generate(target, PROMPTS[2], params, "ngram", depth=0)
    draft = engines("llama", "100%")
    vocab = dict(target.tokenizer.backend.get_vocab())
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    other = Tokenizer.from_backend(HFTokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")),
                                   eos_token_ids=target.tokenizer.eos_token_ids)
    with pytest.raises(ConfigError, match="vocabulary differs"):
        make_stepper(target.model, target.model.new_cache(16), Sampler(params), "draft", draft=draft.model,
                     tokenizer=target.tokenizer, draft_tokenizer=other)
    with pytest.raises(ConfigError, match="vocab_size"):  # no tokenizers to compare: the sizes must agree
        check_same_vocabulary(None, None, 512, 4096)


def test_self_drafter_routing_restriction():
    """Non-resident experts are skipped and the kept weights rescaled to the row's total; skipped slots point at
    an expert the token keeps (weight 0), so nothing missing is acquired; optionally only the heaviest few."""
    indices = torch.tensor([[3, 5, 7, 9], [1, 2, 4, 5], [8, 6, 0, 2]])
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.5, 0.2, 0.2, 0.1]])
    idx, w = restrict(indices, weights, torch.tensor([3, 7, 6]))
    assert torch.allclose(w[[0, 2]].sum(-1), weights[[0, 2]].sum(-1))
    assert torch.allclose(w[0], torch.tensor([0.4, 0.0, 0.2, 0.0]) / 0.6)
    assert idx[0].tolist() == [3, 3, 7, 3] and set(idx[2].tolist()) == {6}
    assert idx[1].tolist() == [3, 3, 3, 3] and bool((w[1] == 0).all())  # nothing resident: routed output 0
    idx, w = restrict(indices, weights, torch.tensor([3, 7, 6, 8, 0]), keep_top=1)
    assert torch.allclose(w[2], torch.tensor([1.0, 0.0, 0.0, 0.0])) and idx[2].tolist() == [8, 8, 8, 8]


def test_plain_stepper_for_off(engines):
    target = engines("qwen", "100%")
    stepper = make_stepper(target.model, target.model.new_cache(16), Sampler(SamplingParams()), "off")
    assert isinstance(stepper, PlainStepper)
    stepper = make_stepper(target.model, target.model.new_cache(16), Sampler(SamplingParams()), "ngram")
    assert isinstance(stepper, SpeculativeStepper)


def test_ngram_follows_a_growing_context_and_starts_over_on_another():
    """The n-gram drafter indexes only what the context added since its last proposal (the stepper's context only
    grows within a request) and starts over where the context is another one."""
    from offload_engine.speculative.drafters import DraftBudget
    from offload_engine.speculative.drafters.ngram import NgramDrafter

    d, budget = NgramDrafter(), DraftBudget(depth=2)
    state = None  # the n-gram drafter reads only the context
    context = [5, 6, 7, 1, 2, 5, 6]
    assert d.propose(context, state, budget).tokens == [7, 1]  # ... 5 6 -> 7 1, as earlier in the context
    context += [9, 9, 5]
    assert d.propose(context, state, budget).tokens == [6, 9]  # 9 5 is new; 5 -> 6 9, its latest continuation
    other = [8, 3, 4, 8, 3, 1, 1, 1, 1, 1, 8, 3]  # another, longer context (its 10th token differs)
    assert d.propose(other, state, budget).tokens == [1, 1]  # 8 3 -> 1 1 there: indexed afresh
    assert d.propose([8, 3, 4, 8], state, budget).tokens == [3, 4]  # a shorter one: afresh too
