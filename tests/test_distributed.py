"""Pipeline parallelism over torch.distributed (gloo, ranks as processes on this box): the same greedy tokens and
the same fp32 logits as the single-process engine, at full and 25% budgets per rank, for qwen3_moe, deepseek_v3
(with MTP drafting) and qwen3_5_moe (DeltaNet state per rank); speculative decoding stays lossless across ranks
(greedy, and seeded sampling: the same tokens as the single process)."""
from __future__ import annotations

import pytest
import torch

from offload_engine import Budget, Engine
from tests.distributed_ranks import run_ranks

PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]  # repeats: the n-gram drafter has something to propose
AGAIN = PROMPT[:6] + [9, 8]  # shares 6 positions with the first request: the cache is trimmed back to them
GREEDY = dict(max_new_tokens=6, ignore_eos=True)
SAMPLED = dict(max_new_tokens=6, ignore_eos=True, temperature=0.9, top_k=50, seed=7)
BUDGETS = {"full": {}, "25%": {"budget": Budget(ram="25%")}}
ARCHS = {"qwen3_moe": {}, "deepseek_v3": {"mtp": 1}, "qwen3_5_moe": {}}
# per arch, the speculative mode checked lossless across ranks (deepseek_v3: its MTP layers on rank 0)
SPEC = {"qwen3_moe": "ngram", "deepseek_v3": "mtp", "qwen3_5_moe": "ngram"}
# qwen3_5_moe's recurrent layers cannot rewind 10 positions to AGAIN's prefix after one 11-token prefill (their
# window), which rank 0's layers alone could (on 4 ranks only full attention is there): every rank must refuse the
# trim (a fresh cache) rather than the pipeline break; prefilled in chunks of 4 they can, and every rank trims
OPTIONS = {("qwen3_5_moe", "25%"): {"prefill_chunk": 4}}
REUSED = {("qwen3_5_moe", "full"): 0, ("qwen3_5_moe", "25%"): 6,
          ("deepseek_v3", "full"): 0, ("deepseek_v3", "25%"): 0}  # its requests speculate (MTP): no reuse


@pytest.fixture(scope="module")
def models(checkpoint_factory):
    return {arch: str(checkpoint_factory(arch, "offload", **opts)) for arch, opts in ARCHS.items()}


def single(path: str, options: dict, spec: str):
    with Engine.open(path, device="cpu", spec="mtp" if spec == "mtp" else "off", **options) as engine:
        tokens = engine.generate(PROMPT, **GREEDY).token_ids
        again = engine.generate(AGAIN, **GREEDY)
        sampled = engine.generate(PROMPT, **SAMPLED, spec=spec).token_ids
        return tokens, again, sampled, engine.logits(PROMPT)


def jobs(models: dict[str, str]) -> list[dict]:
    out = []
    for arch, path in models.items():
        for name, budget in BUDGETS.items():
            spec, options = SPEC[arch], {**budget, **OPTIONS.get((arch, name), {})}
            opened = {**options, "spec": "mtp"} if spec == "mtp" else options
            out.append({"path": path, "options": opened, "logits": PROMPT, "arch": arch, "budget": name,
                        "generate": {"greedy": (PROMPT, GREEDY), "again": (AGAIN, GREEDY),
                                     "spec": (PROMPT, {**GREEDY, "spec": spec}),
                                     "sampled": (PROMPT, {**SAMPLED, "spec": spec})}})
    return out


def check(world: int, models: dict[str, str]) -> None:
    todo = jobs(models)
    results = run_ranks(world, todo)
    for job, got in zip(todo, results):
        what = f"{job['arch']} at {job['budget']} on {world} ranks"
        tokens, again, sampled, logits = single(job["path"], {**BUDGETS[job["budget"]],
                                                                 **OPTIONS.get((job["arch"], job["budget"]), {})},
                                       SPEC[job["arch"]])
        assert got["greedy"]["tokens"] == tokens, what
        assert got["again"]["tokens"] == again.token_ids, what
        assert got["again"]["stats"]["reused_prompt_tokens"] == again.stats["reused_prompt_tokens"], what
        assert again.stats["reused_prompt_tokens"] == REUSED.get((job["arch"], job["budget"]), 6), what
        assert torch.equal(got["logits"], logits), what
        assert got["spec"]["tokens"] == tokens, what + " (speculative)"
        assert got["sampled"]["tokens"] == sampled, what + " (seeded sampling, speculative)"
        stats = got["greedy"]["stats"]
        assert stats["world_size"] == world
        ranks = stats["ranks"]
        assert [r["rank"] for r in ranks] == list(range(world))
        # stages in ring order from rank 1: contiguous, covering every layer once, the head on rank 0
        order = ranks[1:] + ranks[:1]
        assert order[0]["layers"][0] == 0 and order[-1]["layers"][1] == 3
        assert all(a["layers"][1] + 1 == b["layers"][0] for a, b in zip(order, order[1:]))
        assert [r["head"] for r in ranks] == [True] + [False] * (world - 1)
        assert [r["embedding"] for r in order] == [True] + [False] * (world - 1)
        for r in ranks:
            host = r["budget_bytes"]["host"]
            assert r["peak_bytes"]["host"] > 0 and (host is None or r["peak_bytes"]["host"] <= host), what
        spec = got["spec"]["stats"]
        assert spec["spec"] == SPEC[job["arch"]] and spec["target_forwards"] <= len(tokens)
        if job["arch"] == "deepseek_v3":
            assert spec["draft_tokens"] > 0, "MTP drafted across ranks"


def test_two_ranks_match_one_process(models):
    check(2, models)


def test_four_ranks_match_one_process(models):
    check(4, models)
