"""Pipeline parallelism over torch.distributed (gloo, ranks as processes on this box): the same greedy tokens and
the same fp32 logits as the single-process engine, at full and 25% budgets per rank."""
from __future__ import annotations

import pytest
import torch

from offload_engine import Budget, Engine
from tests.distributed_ranks import run_ranks

PROMPT = [1, 2, 3, 4, 5, 6, 7]
GREEDY = dict(max_new_tokens=6, ignore_eos=True)
BUDGETS = {"full": {}, "25%": {"budget": Budget(ram="25%")}}


def single(path, **options):
    with Engine.open(path, device="cpu", **options) as engine:
        return engine.generate(PROMPT, **GREEDY).token_ids, engine.logits(PROMPT)


@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_two_ranks_match_one_process(checkpoint_factory, arch):
    path = str(checkpoint_factory(arch, "offload"))
    jobs = [{"path": path, "options": options, "generate": {"greedy": (PROMPT, GREEDY)}, "logits": PROMPT}
            for options in BUDGETS.values()]
    results = run_ranks(2, jobs)
    for (name, options), got in zip(BUDGETS.items(), results):
        tokens, logits = single(path, **options)
        assert got["greedy"]["tokens"] == tokens, name
        assert torch.equal(got["logits"], logits), name
        stats = got["greedy"]["stats"]
        assert stats["world_size"] == 2
        assert [r["layers"] for r in stats["ranks"]] == [[2, 3], [0, 1]]
        assert [(r["embedding"], r["head"]) for r in stats["ranks"]] == [(False, True), (True, False)]
        assert all(r["peak_bytes"]["host"] > 0 for r in stats["ranks"])
