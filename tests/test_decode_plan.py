"""A decode step through every layer in one native call where the weights never move (runtime/decode_plan.py,
kernels/native/decode_plan.cpp): every step's logits are the bits of the layer loop's one-call blocks, for plain
bf16 and int8 / int4 weights, and the store counts the same hits; models or budgets it does not fit keep the
loop."""
from __future__ import annotations

import pytest
import torch

from offload_engine import Budget, Engine
from offload_engine.planner import costs
from offload_engine.runtime import decode_plan
from offload_engine.runtime.arch import OPS
from offload_engine.runtime.kernels import native_build

from test_native_layer_block import decode_logits

native = native_build.load()
pytestmark = pytest.mark.skipif(native is None, reason=f"native kernels unavailable: {native_build.why_not()}")


def hits(engine: Engine) -> int:
    return sum(engine.model.source.stats.hits.values())


@pytest.mark.parametrize("quant", [None, "ct-int8", "ct-int4"])
def test_the_plan_gives_the_layer_loops_bits_and_hits(quant: str | None, checkpoint_factory, monkeypatch) -> None:
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "all")
    path = checkpoint_factory("qwen3_moe", "offload", dtype="bfloat16", **({"quant": quant} if quant else {}))
    runs: list[bool] = []
    real_run = decode_plan.DecodePlan.run
    monkeypatch.setattr(decode_plan.DecodePlan, "run",
                        lambda *a: (lambda out: runs.append(out is not None) or out)(real_run(*a)))
    with Engine.open(path, max_context=64) as engine:
        before = hits(engine)
        ours = decode_logits(engine)
        ours_hits = hits(engine) - before
        plan = engine.model.decode_plan
        assert plan is not None and plan.native.layers == engine.model.num_layers
        assert runs and all(runs)  # every one-row step took it
        engine.model.layer_loop_only()
        before = hits(engine)
        theirs = decode_logits(engine)
        theirs_hits = hits(engine) - before
    assert torch.equal(ours, theirs)
    assert ours_hits == theirs_hits


@pytest.mark.parametrize("arch,ram,why", [("qwen3_moe", "25%", "not all pinned"),
                                          ("qwen2_moe", None, "shared experts"), ("llama", None, "dense layers")])
def test_no_plan_where_the_layer_loop_does_more(arch: str, ram: str | None, why: str, checkpoint_factory,
                                                monkeypatch) -> None:
    """A budget that streams (units move, the prefetcher follows the loop), shared experts, dense layers: no
    plan, and decoding goes on through the loop."""
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "all")
    path = checkpoint_factory(arch, "offload", dtype="bfloat16")
    budget = {"budget": Budget(ram=ram)} if ram else {}
    with Engine.open(path, max_context=64, **budget) as engine:
        out = engine.generate([3, 4, 5], max_new_tokens=3, ignore_eos=True)
        assert len(out.token_ids) == 3
        assert engine.model.decode_plan is None and decode_plan.build(engine.model) is None, why


def test_the_native_plan_checks_its_layers() -> None:
    plan = native.DecodePlan(1e-6, 0.125, 2, True)
    ones, w = torch.ones(64).bfloat16(), torch.randn(64, 64).bfloat16()
    with pytest.raises(RuntimeError, match="layer 0 has no router"):
        plan.add_layer(ones, ones, [[w]] * 3, None, None, [w], [], [[w]] * 2, [[w]] * 2, [[w]] * 2)
    with pytest.raises(RuntimeError, match="fewer than top-k 2"):
        plan.add_layer(ones, ones, [[w]] * 3, None, None, [w], [w], [[w]], [[w]], [[w]])
    with pytest.raises(RuntimeError, match="one k and v cache per layer"):
        plan.run(torch.zeros(1, 64).bfloat16(), [torch.zeros(1)], [], ones, ones, 0)


def test_the_planner_names_the_architectures_the_plan_takes() -> None:
    """planner/costs.py ONE_CALL_ARCHS (the planner may not import the runtime) against the ops classes."""
    assert costs.ONE_CALL_ARCHS == {name for name, ops in OPS.items() if ops.keeps_standard_block()}
