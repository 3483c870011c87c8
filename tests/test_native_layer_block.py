"""A decode step's blocks in one native call each (runtime/kernels/native/layer_cpu.cpp: StandardOps.decode_block's
attention block, MoEBlock.one_row's routed experts and sum) and the store's all-resident hand-over
(TieredStore.acquire_ready): the logits of every step are the bits of the one-kernel-at-a-time path, for plain bf16
and int8 / int4 weights, MoE and dense layers; layers they cannot take (biases) keep that path."""
from __future__ import annotations

import pytest
import torch

from offload_engine import Budget, Engine
from offload_engine.checkpoint.naming import UnitKey
from offload_engine.runtime import moe_block
from offload_engine.runtime.arch import base
from offload_engine.runtime.kernels import native_build

native = native_build.load()
needs_native = pytest.mark.skipif(native is None, reason=f"native kernels unavailable: {native_build.why_not()}")


def decode_logits(engine: Engine, steps: int = 6) -> torch.Tensor:
    model = engine.model
    cache = model.new_cache(32)
    token = int(model.forward(torch.tensor([5, 17, 30, 41]), cache)[-1].argmax())
    rows = []
    for _ in range(steps):
        rows.append(model.forward(torch.tensor([token]), cache))
        token = int(rows[-1][-1].argmax())
    return torch.cat(rows)


@needs_native
@pytest.mark.parametrize("arch,quant,block,moe_row", [("qwen3_moe", None, True, True),
                                                      ("qwen3_moe", "ct-int8", True, True),
                                                      ("qwen3_moe", "ct-int4", True, True), ("llama", None, True, False),
                                                      ("qwen2_moe", None, False, True)])
def test_one_call_blocks_give_the_bits_of_the_kernels_one_by_one(arch: str, quant: str | None, block: bool,
                                                                 moe_row: bool, checkpoint_factory,
                                                                 monkeypatch) -> None:
    """qwen2_moe: q/k/v biases keep its attention on the one-by-one path, its shared experts join moe_row's sum."""
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "all")
    path = checkpoint_factory(arch, "offload", dtype="bfloat16", **({"quant": quant} if quant else {}))
    taken: dict[str, list[bool]] = {"block": [], "moe_row": []}

    def counted(real, name):
        return lambda *a: (lambda r: taken[name].append(r is not None) or r)(real(*a))
    with Engine.open(path, max_context=64) as engine:
        engine.model.layer_loop_only()  # not all layers in one call (test_decode_plan.py)
        monkeypatch.setattr(base.StandardOps, "decode_block", counted(base.StandardOps.decode_block, "block"))
        monkeypatch.setattr(moe_block.MoEBlock, "one_row", counted(moe_block.MoEBlock.one_row, "moe_row"))
        ours = decode_logits(engine)
        monkeypatch.setattr(base.StandardOps, "decode_block", lambda *a: None)
        monkeypatch.setattr(moe_block.MoEBlock, "one_row", lambda *a: None)
        theirs = decode_logits(engine)
    assert any(taken["block"]) == block and any(taken["moe_row"]) == moe_row
    assert torch.equal(ours, theirs)


@needs_native
def test_the_blocks_refuse_mixed_forms_by_name() -> None:
    x, w = torch.randn(1, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    ones = torch.ones(64).bfloat16()
    cache = torch.zeros(4, 1, 64).bfloat16()
    cs = torch.zeros(1, 64).bfloat16()
    int8 = [torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 1).bfloat16()]
    with pytest.raises(RuntimeError, match="all plain or all int"):
        native.attention_block(x, ones, ones, 1e-6, [[w], int8, [w]], None, None, cs, cs, cache, cache.clone(), 0,
                               1.0, [w], [])
    with pytest.raises(RuntimeError, match="experts all plain or all int"):
        native.moe_row(x, x, torch.ones(2).bfloat16(), [0, 1], [[w], int8], [[w], []], [[w], int8], None)
    with pytest.raises(RuntimeError, match="slot 5 outside the weights"):
        native.moe_row(x, x, torch.ones(2).bfloat16(), [5], [[w]], [[w]], [[w]], None)


def test_acquire_ready_takes_all_or_nothing(checkpoint_factory) -> None:
    """All resident: acquired and counted as acquire() would (a hit each, released as usual). One missing: None,
    nothing acquired, nothing counted."""
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64) as engine:
        engine.generate([3, 4, 5], max_new_tokens=4, ignore_eos=True)
        store = engine.model.source
        resident = sorted(k for k in store.resident_keys() if k.kind == "expert")[:3]
        missing = next(k for k in store.checkpoint.layouts if k.kind == "expert" and k not in set(
            store.resident_keys()))
        hits = dict(store.stats.hits)
        units = store.acquire_ready(resident)
        assert units is not None and len(units) == 3
        assert all(store.compute.resident[k].refs == 1 for k in resident)
        assert store.stats.hits[store.compute.name] == hits[store.compute.name] + 3
        store.release(resident)
        assert all(store.compute.resident[k].refs == 0 for k in resident)
        tick = store.tick
        assert store.acquire_ready(resident + [missing]) is None
        assert store.tick == tick and all(store.compute.resident[k].refs == 0 for k in resident)
        assert store.stats.hits[store.compute.name] == hits[store.compute.name] + 3
        assert isinstance(missing, UnitKey)
