"""Budgets over real checkpoints (RELIABILITY 5: M1-M3, M6; issue 9 item 4).

1,000 randomized cases over budget x model (several architectures, tiny and expert-heavy presets) x context x
direct I/O, through the engine's own planning path (`plan_for`, as Engine.open calls it) and its own allocation
path (the store's Tier.allocate charging the Ledger before each allocation): a feasible plan never takes more
than its budget, the ledger's peak never exceeds it and matches the bytes really allocated (the process's RSS
grows by no more than those), the plan is deterministic, and an infeasible case is refused at plan time with
numbers, tightly (the budget it asks for works). A sample runs through real engines, checked against the OS too
(tests/os_memory.py; test_budgets.py measures a 109 MB checkpoint in a clean process). An allocation failure
injected mid-generation fails that request only: the ledger and every slot are back to their state before it,
and the next request is bitwise right.

OFFLOAD_ENGINE_BUDGET_CASES sets the randomized cases (default 1000).
"""
from __future__ import annotations

import os
import threading
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_engine import Budget, BudgetError, Engine, OffloadEngineError
from offload_engine.checkpoint.model import open_model
from offload_engine.planner.placement import ResolvedBudget
from offload_engine.runtime import kv_cache, kv_storage
from offload_engine.store.build import plan_for
from offload_engine.store.ledger import Ledger
from offload_engine.store import tier as tier_mod
from offload_engine.store.tier import Tier
from offload_engine.store.unit_io import copy_bytes
from tests.figures import Figures
from tests.os_memory import measured, rss, shards, slack

CASES = int(os.environ.get("OFFLOAD_ENGINE_BUDGET_CASES", 1000))
MODELS = [("qwen3_moe", "tiny"), ("mixtral", "tiny"), ("deepseek_v3", "tiny"), ("qwen2_moe", "tiny"),
          ("llama", "tiny"), ("qwen3_moe", "offload"), ("mixtral", "offload"), ("deepseek_v3", "offload")]
CPU = torch.device("cpu")
# RSS growth allowed beyond the slots' bytes while a placement is allocated: the Slot objects, a page of rounding
# per pool (pools of 2 MiB and more are faulted in at allocation, smaller ones are torch.empty, untouched)
ALLOC_SLACK = 2 << 20
FIGURES = Figures("budgets")
report_figures = FIGURES.fixture()
tally = FIGURES.tally




@pytest.fixture(scope="module")
def checkpoints(checkpoint_factory):
    return [open_model(checkpoint_factory(arch, preset)) for arch, preset in MODELS]


def kv_bytes(ck, context: int) -> int:
    """As Engine.open reserves it (float32 compute on CPU): KV per position, plus recurrent state if any."""
    from offload_engine.runtime.arch import build_ops

    ops = build_ops(ck.arch.name, ck.args, CPU, torch.float32)
    n = context * ops.kv_bytes_per_token(4)
    if hasattr(ops, "state_bytes"):
        n += ops.state_bytes(4, rollback=getattr(kv_cache, "ROLLBACK", 0))
    return n


def allocate(placement) -> Ledger:
    """What TieredStore.__init__ allocates for a placement, through the same Tier/Ledger code (no reads). The
    ledger counts the slots' real bytes, and the OS gave the process no more than those (its RSS growth)."""
    ledger = Ledger({t.name: t.budget for t in placement.tiers})
    tiers, slots, before = [], 0, rss()
    for plan in placement.tiers:
        tier = Tier(plan.name, CPU, set(plan.pinned))
        tiers.append(tier)
        tier.provision(plan, placement.sizes, ledger, pin_memory=False)
        real = sum(s.blob.numel() * s.blob.element_size() for pool in tier.pools.values() for s in pool)
        assert real + plan.staging_bytes + plan.kv_bytes == ledger.accounts[tier.name].charged  # counts real bytes
        slots += real
    grown = rss() - before
    assert grown <= slots + ALLOC_SLACK, (grown, slots)  # no hidden copy, no allocator rounding beyond a page
    key = "max_rss_growth_over_slot_bytes_KiB"
    FIGURES[key] = max(FIGURES.get(key, -(1 << 30)), (grown - slots) // 1024)
    for plan, tier in zip(placement.tiers, tiers):  # as TieredStore.close gives it back
        tier.unprovision(plan, ledger)
    return ledger


share = st.floats(0.0, 1.3, allow_nan=False)
fraction = st.one_of(st.none(), share, share, share, st.integers(0, 64 << 20))


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(model=st.integers(0, len(MODELS) - 1), ram=fraction, vram=st.one_of(st.none(), st.none(), fraction),
       context=st.one_of(st.integers(1, 64), st.integers(1, 512), st.integers(1, 512), st.integers(1, 4096)),
       direct_io=st.sampled_from(["off", "on", "auto"]))
def test_randomized_budgets_plan_and_ledger(checkpoints, model, ram, vram, context, direct_io):
    ck = checkpoints[model]
    kv = kv_bytes(ck, context)

    def resolve(v):  # a float: that share of what everything would take (weights + KV cache), as with --ram 25%
        return None if v is None else (int(v * (ck.total_bytes + kv)) if isinstance(v, float) else v)

    budget = ResolvedBudget(device=resolve(vram), host=resolve(ram))
    tally("budget_cases")
    try:
        placement, direct = plan_for(ck, budget, CPU, kv, direct_io)
    except BudgetError as e:
        tally("refused_at_plan_time")
        assert e.required > e.available >= 0 and e.breakdown, e  # refused with numbers
        assert str(e.required) in str(e) and str(e.available) in str(e)
        separate = budget.device is not None
        if kv and e.resource == ("device" if separate else "host"):
            assert "kv cache" in e.breakdown  # the compute tier's refusal itemizes the KV cache
        # tight: the budget it asks for is enough for that tier (another tier may still be short)
        key = "device" if (separate and e.resource == "device") else "host"
        raised = ResolvedBudget(**{**vars(budget), key: e.required})
        try:
            plan_for(ck, raised, CPU, kv, direct_io)
        except BudgetError as again:
            assert again.resource != e.resource or again.required != e.required, (e, again)
        return
    tally("feasible")
    for tier in placement.tiers:
        if tier.budget is not None:
            assert tier.used(placement.sizes) <= tier.budget
    ledger = allocate(placement)
    for name, acct in ledger.accounts.items():
        assert acct.budget is None or acct.peak <= acct.budget, (name, acct.peak, acct.budget)
        assert acct.charged == 0, (name, acct.items)  # every byte given back
    again, direct_again = plan_for(ck, budget, CPU, kv, direct_io)
    assert again.to_json() == placement.to_json() and direct_again == direct  # deterministic


@settings(max_examples=int(os.environ.get("OFFLOAD_ENGINE_BUDGET_ENGINES", 16)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(model=st.sampled_from([5, 6, 7, 0, 2]), ram=st.integers(3, 110), vram=st.one_of(st.none(), st.integers(2, 40)),
       context=st.integers(16, 256), direct_io=st.sampled_from(["off", "auto"]))
def test_sample_through_real_engines(checkpoint_factory, model, ram, vram, context, direct_io):
    path = checkpoint_factory(*MODELS[model])
    tally("budget_cases_real_engine")
    with measured(shards(path), every=0.02, collect=False) as grown:
        threads = threading.active_count()  # the measurement's sampler thread included
        try:
            engine = Engine.open(path, budget=Budget(ram=f"{ram}%", vram=None if vram is None else f"{vram}%"),
                                 max_context=context, direct_io=direct_io)
        except BudgetError as e:
            tally("refused_at_plan_time")
            assert e.required > e.available
            assert threading.active_count() == threads  # refused before any reader thread started
            return
        with engine:
            stats = engine.generate([1, 2, 3, 4, 5], max_new_tokens=3, ignore_eos=True).stats
            for tier in ("device", "host"):
                if stats["budget_bytes"][tier] is not None:
                    assert stats["peak_bytes"][tier] <= stats["budget_bytes"][tier]
            ledger = engine.store.ledger
    assert all(v == 0 for v in ledger.charged().values()), ledger.charged()
    # the OS agrees (in this process, so the figures can only be low): peak RSS growth plus the checkpoint's
    # cached pages within the budgets plus slack; with --direct-io off the page cache is asked for, not counted
    budget = sum(b for b in stats["budget_bytes"].values() if b is not None)
    taken = grown.rss + (grown.cache if direct_io != "off" else 0)
    assert taken <= budget + slack(budget), (grown, budget, direct_io)


# ---- M6: an allocation failure mid-generation fails that request only ---------------------------------------

class FakeAllocator:
    """A device allocator with a failure switch: `torch.empty` as the KV cache sees it raises an out-of-memory
    error on the k-th allocation after arm(k), as a CUDA caching allocator does when the device is full."""

    def __init__(self):
        self.calls, self.fail_at = 0, None

    def arm(self, k: int) -> None:
        self.fail_at = self.calls + k

    def empty(self, *args, **kwargs):
        return self.wrap(torch.empty)(*args, **kwargs)

    def wrap(self, allocate):
        """`allocate` (torch.empty, store.hostmem.host_buffer) counted against the same failure switch."""
        def call(*args, **kwargs):
            self.calls += 1
            if self.fail_at is not None and self.calls >= self.fail_at:
                self.fail_at = None
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
            return allocate(*args, **kwargs)
        return call


def snapshot(engine: Engine) -> dict:
    store = engine.store
    slots = store.slot_states()
    return {"charged": store.ledger.charged(), "refs": sum(s.refs for s in slots),
            "loading": sum(1 for s in slots if s.reading)}


def wait_idle(engine: Engine) -> dict:
    import time

    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        snap = snapshot(engine)
        if not snap["loading"]:
            return snap
        time.sleep(0.02)
    return snapshot(engine)


def torch_with(empty) -> types.SimpleNamespace:
    """The torch module as one engine module sees it, with its own `empty`."""
    fake = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    fake.empty = empty
    return fake


@pytest.fixture
def fake_alloc(monkeypatch):
    alloc = FakeAllocator()
    monkeypatch.setattr(kv_storage, "torch", torch_with(alloc.empty))  # where the KV cache allocates
    return alloc


@pytest.mark.parametrize("where", ["kv-cache", "expert-compute", "host-to-device-copy"])
def test_allocation_failure_mid_generation_fails_that_request_only(checkpoint_factory, fake_alloc, where):
    path = checkpoint_factory("qwen3_moe", "offload")
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    with Engine.open(path, max_context=64) as ref_engine:
        ref = ref_engine.generate(prompt, max_new_tokens=4, ignore_eos=True).token_ids
    calls = {"n": 0, "fail_at": None}

    def failing(inner):  # from the k-th call on, until the request has failed (memory stays short meanwhile)
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["fail_at"] is not None and calls["n"] >= calls["fail_at"]:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB (injected)")
            return inner(*args, **kwargs)
        return wrapped

    # the host-to-device copy fails through the store's injectable I/O (UnitIO's copy_fn)
    copy_fn = failing(copy_bytes) if where == "host-to-device-copy" else None
    engine = Engine.open(path, budget=Budget(vram="8%", ram="30%"), max_context=64, direct_io="off",
                         copy_fn=copy_fn)
    engine.reuse_prefix = False  # every request allocates its KV cache (a reused one allocates nothing)
    if where == "expert-compute":
        engine.model.ops.expert = failing(engine.model.ops.expert)
    injected = 0
    try:
        before = wait_idle(engine)
        # the KV cache allocates once per layer per request (4 layers): k up to 4 lands in that request
        for k in ((1, 2, 3, 4, 2, 3) if where == "kv-cache" else (1, 2, 3, 5, 8, 13)):
            if where == "kv-cache":
                fake_alloc.arm(k)
            else:
                calls["fail_at"] = calls["n"] + k
            with pytest.raises((torch.OutOfMemoryError, OffloadEngineError)) as err:
                engine.generate(prompt, max_new_tokens=4, ignore_eos=True)
            calls["fail_at"] = None  # memory is back
            assert "out of memory" in str(err.value).lower()
            injected += 1
            after = wait_idle(engine)
            assert after["refs"] == 0 and after["loading"] == 0, after  # no unit left acquired
            assert after["charged"] == before["charged"], (before, after)  # ledger back to its level
            assert engine.generate(prompt, max_new_tokens=4, ignore_eos=True).token_ids == ref  # next one is right
    finally:
        engine.close()
    tally("allocation_failures_injected", injected)
    assert all(v == 0 for v in engine.store.ledger.charged().values())


def test_allocation_failure_is_reported_as_an_engine_error(checkpoint_factory, fake_alloc):
    """RELIABILITY M6: the request fails with an engine error (exit code 3 from the CLI), not a raw torch error.
    The model's forward wraps torch.OutOfMemoryError in errors.DeviceOOMError (its __cause__)."""
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, direct_io="off") as engine:
        engine.reuse_prefix = False  # the second request allocates its KV cache (a reused one allocates nothing)
        want = engine.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True).token_ids
        fake_alloc.arm(2)
        with pytest.raises(Exception) as err:
            engine.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True)
        assert engine.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True).token_ids == want  # still serving
    assert isinstance(err.value, OffloadEngineError), f"{type(err.value).__name__}: {err.value}"
    assert err.value.exit_code == 3
    assert "out of memory" in str(err.value) and isinstance(err.value.__cause__, torch.OutOfMemoryError)
    tally("allocation_failures_injected")


def test_allocation_failure_of_a_kept_cache_is_an_engine_error(checkpoint_factory, fake_alloc):
    """With prefix reuse (the default), the first request allocates the whole-context cache the engine keeps:
    its allocation failing fails that request with the engine's error, and the next request allocates anew."""
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, direct_io="off") as engine:
        fake_alloc.arm(1)
        with pytest.raises(OffloadEngineError, match="out of memory"):
            engine.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True)
        first = engine.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True)
        again = engine.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True)
    assert first.token_ids == again.token_ids and again.stats["reused_prompt_tokens"] == 2


@pytest.mark.parametrize("k", [1, 2, 3])
def test_allocation_failure_while_opening_is_an_engine_error(checkpoint_factory, monkeypatch, k):
    """The allocator refuses a slot pool the plan budgeted (memory taken outside the budget, a fragmented
    device): Engine.open fails with an engine error naming the tier and slot, before any reader thread starts.
    On the CPU each kind's pool is one allocation (store.hostmem): the head's, the dense layers' or the experts'
    fails."""
    alloc = FakeAllocator()
    monkeypatch.setattr(tier_mod, "torch", torch_with(alloc.empty))
    monkeypatch.setattr(tier_mod, "host_buffer", alloc.wrap(tier_mod.host_buffer))
    path = checkpoint_factory("qwen3_moe", "offload")
    threads = threading.active_count()
    alloc.arm(k)
    with pytest.raises(OffloadEngineError) as err:
        Engine.open(path, budget=Budget(ram="25%"), max_context=64, direct_io="off")
    assert err.value.exit_code == 3 and "out of memory" in str(err.value) and "slot" in str(err.value), err.value
    assert threading.active_count() == threads
    tally("allocation_failures_injected")
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, direct_io="off") as engine:  # memory is back
        engine.generate([1, 2, 3], max_new_tokens=1)
