"""Prefetch never changes what is computed: any depth, on or off, random read delays -> identical tokens."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch

from offload_engine import Budget, Engine, PrefetchConfig
from offload_engine.prefetch.predictor import Combined, FrequencyPrior
from offload_engine.prefetch.prefetcher import ROUTE_AHEAD_TOKENS, PayCheck
from offload_engine.checkpoint.naming import UnitKey
from offload_engine.errors import ConfigError
from offload_engine.store.disk import read_range

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


class RandomDelays:
    def __init__(self, seed: int):
        self.rng, self.lock = random.Random(seed), threading.Lock()

    def __call__(self, files, r, blob):
        with self.lock:
            delay = self.rng.choice([0, 0, 0.001, 0.003])
        time.sleep(delay)
        read_range(files, r, blob)


@pytest.fixture(scope="module")
def reference(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, max_context=64) as engine:
        return path, engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True).token_ids


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("ram,vram", [("25%", None), ("10%", None), ("40%", "10%")])
def test_prefetch_depths_and_delays_match_resident(reference, depth, ram, vram):
    path, expected = reference
    config = PrefetchConfig(depth=depth, adaptive=False, route_ahead=0)  # the lookahead reads in decode too
    with Engine.open(path, budget=Budget(ram=ram, vram=vram), max_context=64, prefetch=config,
                     direct_io="off", read_fn=RandomDelays(depth)) as engine:
        completion = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert completion.token_ids == expected
    stats = completion.stats
    assert stats["prefetch"]["enabled"] and stats["prefetch_issued"] > 0
    assert 0.0 <= stats["prefetch"]["recall"] <= 1.0


@pytest.mark.parametrize("route_ahead", [0, 1])
def test_the_lookahead_predicts_only_in_forwards_that_do_not_route_ahead(reference, route_ahead):
    """Decode forwards route ahead (a far better predictor of the experts that miss): the router lookahead then
    predicts and reads nothing; a prefill of more than ROUTE_AHEAD_TOKENS tokens still uses it."""
    path, _ = reference
    prompt = PROMPT * 2  # 20 tokens
    config = PrefetchConfig(adaptive=False, route_ahead=route_ahead)
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, prefetch=config, direct_io="off") as engine:
        prefetcher = engine.model.prefetcher
        tokens_seen, predict = [], prefetcher.predictor.predict

        def spy(layer, x, horizon):
            tokens_seen.append(x.shape[0])
            return predict(layer, x, horizon)

        prefetcher.predictor.predict = spy
        engine.generate(prompt, max_new_tokens=8, ignore_eos=True)
    assert len(prompt) > ROUTE_AHEAD_TOKENS and len(prompt) in tokens_seen  # the prefill
    assert (1 in tokens_seen) == (route_ahead == 0)


def test_prefetch_off_matches(reference):
    path, expected = reference
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, prefetch=False) as engine:
        completion = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert completion.token_ids == expected
    assert completion.stats["prefetch_issued"] == 0


@pytest.mark.parametrize("field, value", [("depth", 0), ("reads", -1), ("route_ahead", -1), ("route_ahead", 1.5),
                                          ("slots", True)])
def test_prefetch_config_refuses_bad_values_by_name(field, value):
    with pytest.raises(ConfigError, match=rf"PrefetchConfig.{field} (\(--[a-z-]+\) )?must be an integer"):
        PrefetchConfig(**{field: value})


def test_frequency_prior_and_combination():
    prior = FrequencyPrior([0, 1], top_k=2)
    for experts in ([1, 2], [1, 3], [1, 2]):
        prior.observe(1, experts)
    ranked = prior.predict(0, torch.zeros(1, 4), horizon=1)
    assert ranked[0] == (UnitKey(1, "expert", 1), 1.0)
    assert {k.expert for k, _ in ranked} == {1, 2, 3}

    class Fixed:
        def predict(self, layer, hidden, horizon):
            return [(UnitKey(1, "expert", 3), 0.5)]

        def observe(self, layer, experts):
            pass

    combined = dict(Combined(prior, Fixed()).predict(0, torch.zeros(1, 4), 1))
    assert combined[UnitKey(1, "expert", 3)] == pytest.approx(1 - (1 - 1 / 3) * 0.5)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_forwards(pay: PayCheck, clock: FakeClock, n: int, on_s: float, off_s: float, tokens: int = 1) -> list[bool]:
    """n forwards, each taking on_s or off_s depending on the setting PayCheck chose for it."""
    settings = []
    for _ in range(n):
        on = pay.forward_started(tokens)
        settings.append(on)
        clock.now += on_s if on else off_s
        pay.forward_finished()
        clock.now += 5.0  # the caller's time between forwards (a slow consumer of the stream): never counted
    return settings


@pytest.mark.parametrize("on_s, off_s, verdict", [(1.0, 2.0, True), (2.0, 1.0, False), (1.0, 1.0, False),
                                                  (0.97, 1.0, False), (0.94, 1.0, True)])  # MARGIN: 5%
def test_pay_check_keeps_the_faster_setting_and_holds_it_longer_while_it_repeats(on_s, off_s, verdict):
    clock = FakeClock()
    pay = PayCheck(clock)
    n = PayCheck.TRIAL
    settings = run_forwards(pay, clock, 2 * n + 1, on_s, off_s)
    assert settings == [True] * n + [False] * n + [verdict]
    assert pay.verdicts == [verdict]
    held = run_forwards(pay, clock, PayCheck.HOLD - 1, on_s, off_s)
    assert held == [verdict] * (PayCheck.HOLD - 1)
    second = run_forwards(pay, clock, 2 * PayCheck.TRIAL + 1, on_s, off_s)  # the next trial, same outcome
    assert second == [False] * n + [True] * n + [verdict]  # trials alternate which setting they time first
    assert pay.verdicts == [verdict, verdict]
    assert run_forwards(pay, clock, 2 * PayCheck.HOLD - 1, on_s, off_s) == [verdict] * (2 * PayCheck.HOLD - 1)


def test_pay_check_times_only_single_token_forwards():
    clock = FakeClock()
    pay = PayCheck(clock)
    run_forwards(pay, clock, 50, 1.0, 2.0, tokens=7)  # prefill / verification passes: not timed, no verdict
    assert pay.verdicts == [] and pay.on


def test_adaptive_prefetch_is_lossless_and_reports_its_trials(reference):
    """The default (adaptive) prefetcher in a real engine with random read delays: same tokens; its pay check
    ran trials, and switching prefetch on and off between forwards never changed a token."""
    path, expected = reference
    with Engine.open(path, budget=Budget(ram="25%"), max_context=128, direct_io="off",
                     read_fn=RandomDelays(7)) as engine:
        long = engine.generate(PROMPT, max_new_tokens=64, ignore_eos=True)
        short = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert short.token_ids == expected and long.token_ids[:24] == expected
    verdicts = long.stats["prefetch"]["pay_check_verdicts"]
    assert len(verdicts) >= 1 and all(isinstance(v, bool) for v in verdicts)
    assert 0.0 <= long.stats["io_overlap"] <= 1.0 and long.stats["read_busy_s"] > 0


def test_cli_prefetch_flags_and_a_recorded_trace(reference, tmp_path, capsys):
    """A trace recorded by tools/trace_experts.py seeds the prior through --trace; a bad one is refused by name."""
    from offload_engine.cli import main
    from tools.trace_experts import main as trace_main

    path, _ = reference
    trace, outputs = tmp_path / "trace.json", []
    assert trace_main(["record", "--model", str(path), "--prompt", "def f():", "--tokens", "8", "--context", "64",
                       "--out", str(trace)]) == 0
    base = ["run", "--model", str(path), "--ram", "25%", "--context", "64", "--max-new-tokens", "24", "--json",
            "--quiet", "--prompt", "x"]
    for extra, enabled in ((["--trace", str(trace), "--prefetch", "on", "--prefetch-depth", "2",
                             "--prefetch-reads", "3", "--route-ahead", "2"], True),
                           (["--prefetch", "off"], False)):
        capsys.readouterr()
        assert main(base + extra) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["stats"]["prefetch"]["enabled"] is enabled
        outputs.append(out["token_ids"])
    assert outputs[0] == outputs[1]
    for text in ('{"counts": {}}', '{"steps": {"12": 40}}'):  # no steps; an older format's dict
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        assert main(base + ["--trace", str(bad)]) != 0
        assert "bad.json" in capsys.readouterr().err
    for flag, bad in (("--prefetch-depth", "0"), ("--prefetch-reads", "-1"), ("--route-ahead", "-1")):
        assert main(base + [flag, bad]) != 0
        assert flag in capsys.readouterr().err
    assert main(base + ["--threads", "0"]) != 0
    assert "--threads" in capsys.readouterr().err
    assert main(base + ["--threads", "1"]) == 0 and torch.get_num_threads() == 1


def wait_landed(store, key: UnitKey, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slot = store.compute.resident.get(key)
        if slot is not None and slot.loading is None:
            return
        time.sleep(0.005)
    raise AssertionError(f"{key} did not land")


def test_store_prefetch_spares_unused_prefetches_and_acquire_reads_before_it_yields():
    """The bundled model at 16% streams its dense units through two slots (one in use): reading the layer
    after next must not evict the next layer's prefetched, unused unit; and acquire starts the read of a
    missing unit before it hands out the resident ones."""
    from offload_engine.defaults import default_model_path

    with Engine.open(default_model_path(), budget=Budget(ram="16%"), max_context=64, prefetch=False) as engine:
        store = engine.store
        assert store.placement.home("dense") == "disk" and store.placement.compute.slots["dense"] == 2
        d0, d1, d2 = (UnitKey(layer, "dense") for layer in range(3))
        store.prefetch([d0])
        wait_landed(store, d0)
        store.prefetch([d1])
        wait_landed(store, d1)
        held = store.acquire([d0])
        next(held)  # layer 0 in use, layer 1 prefetched and not used yet: no slot to spare
        assert store.prefetch([d2]) == 0 and d1 in store.compute.resident
        store.release([d0])
        held.close()
        acquiring = store.acquire([d1, d2])  # d1 resident, d2 missing
        key, _ = next(acquiring)
        assert key == d1 and store.compute.resident[d2].loading is not None  # d2's read already started
        store.release([d1])
        key, _ = next(acquiring)
        assert key == d2
        store.release([d2])
        assert next(acquiring, None) is None


def test_wrong_guesses_evict_at_most_the_quota_and_are_the_first_victims(checkpoint_factory):
    """TieredStore.prefetch_slots: prefetches evict cached experts only while fewer than the quota of slots hold
    unjudged or wrong guesses; past it they recycle stale guesses (marked by cancel_prefetch once routing proves
    them wrong), which are also the first victims of a demand read; a right guess (acquired) frees its place.
    The quota is the store's from construction (PrefetchConfig.slots), here 2, then 1 in a second store."""
    path = checkpoint_factory("qwen3_moe", "offload")

    def opened(slots: int) -> Engine:
        return Engine.open(path, budget=Budget(ram="25%"), max_context=64,
                           prefetch=PrefetchConfig(enabled=False, slots=slots))

    def warm(store):  # every expert slot holds a cached unit: (pool, cached units, experts not resident)
        pool = store.compute.pools["expert"]
        assert all(s.key is not None for s in pool)
        cached = lambda: {s.key for s in pool if not s.prefetched and s.loading is None}  # noqa: E731
        absent = [k for k in store.checkpoint.layouts if k.kind == "expert" and k not in store.compute.resident]
        return pool, cached, absent

    with opened(slots=2) as engine:
        store = engine.store
        engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True)  # every expert slot holds a cached unit
        pool, cached, absent = warm(store)
        assert store.prefetch_slots == 2
        before = cached()
        assert store.prefetch(absent[:6]) == 2  # the quota: two cached experts may go
        for key in absent[:2]:
            wait_landed(store, key)
        assert len(before - cached()) == 2
        store.cancel_prefetch(absent[:2])  # routing proved both wrong: stale
        assert all(store.compute.resident[k].stale for k in absent[:2])
        before = cached()
        assert store.prefetch(absent[2:6], limit=1) == 1  # recycles a stale guess, at most `limit` reads
        wait_landed(store, absent[2])
        assert cached() == before and absent[2] in store.compute.resident
        stale = next(k for k in absent[:2] if k in store.compute.resident)
        for _ in store.acquire([absent[3]]):  # a demand miss evicts the remaining stale guess first
            store.release([absent[3]])
        assert stale not in store.compute.resident and cached() >= before
    with opened(slots=1) as engine:  # a quota of one, already filled by an unjudged guess (absent[2])
        store = engine.store
        engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
        pool, cached, absent = warm(store)
        store.prefetch(absent[2:3])
        wait_landed(store, absent[2])
        assert store.prefetch(absent[4:5]) == 0  # absent[2], not judged yet, fills the quota
        for _ in store.acquire([absent[2]]):  # a right guess joins the cache and frees its quota place
            store.release([absent[2]])
        assert not store.compute.resident[absent[2]].prefetched
        before = cached()
        assert store.prefetch(absent[4:5]) == 1
        wait_landed(store, absent[4])
        assert len(before - cached()) == 1


class SlowReads:
    """Every read takes `delay` seconds more: each layer with a missing expert waits for it."""

    def __init__(self, delay: float):
        self.delay = delay

    def __call__(self, files, r, blob):
        time.sleep(self.delay)
        read_range(files, r, blob)


@pytest.mark.parametrize("route_ahead", [0, 1, 2])
def test_route_ahead_is_lossless_and_names_the_routed_experts(reference, route_ahead):
    """A layer waiting for reads predicts the next layers' routing (CausalLM._route_ahead) and reads their
    experts: the tokens are the resident run's, the predictions are scored against the real routing, and far more
    of what they name is routed than chance would give. The pay-checked lookahead reads nothing here (reads=0)."""
    path, expected = reference
    config = PrefetchConfig(adaptive=False, reads=0, route_ahead=route_ahead)
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, prefetch=config, direct_io="off",
                     read_fn=SlowReads(0.004)) as engine:
        completion = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert completion.token_ids == expected
    ahead, reads = completion.stats["prefetch"]["route_ahead"], completion.stats["expert_reads"]
    # the planner's recall: the share of this request's expert reads made ahead of their use
    assert completion.stats["prefetch"]["recall_effective"] == pytest.approx(
        reads["ahead"] / (reads["ahead"] + reads["demand"]))
    if route_ahead == 0:
        assert ahead == {"precision": 0.0, "recall": 0.0} and completion.stats["prefetch_issued"] == 0
        assert reads["ahead"] == 0 and reads["demand"] > 0
    else:
        assert reads["ahead"] > 0
        chance = engine.model.spec.num_experts_per_tok / engine.model.spec.num_experts  # 4 of 64 experts
        assert ahead["precision"] > 4 * chance and ahead["recall"] > 4 * chance  # measured: 0.63 / 0.46 (depth 2)
        assert completion.stats["prefetch_used"] > 0


def test_acquire_hands_its_wait_to_the_caller_once(checkpoint_factory):
    """TieredStore.acquire calls `while_waiting` once, on the caller's thread, while a read it waits for is still
    in flight (here the read cannot finish before the call), and never when everything is resident."""
    path = checkpoint_factory("qwen3_moe", "offload")
    called, proceed = [], threading.Event()

    def gated(files, r, blob):
        assert proceed.wait(10), "while_waiting was not called while the read was in flight"
        read_range(files, r, blob)

    def while_waiting():
        called.append(threading.get_ident())
        proceed.set()

    proceed.set()  # the load at open is not gated
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, prefetch=False, direct_io="off",
                     read_fn=gated) as engine:
        store = engine.store
        proceed.clear()
        absent = [k for k in store.checkpoint.layouts if k.kind == "expert" and k not in store.compute.resident]
        for key, _ in store.acquire(absent[:2], while_waiting):
            store.release([key])
        assert called == [threading.get_ident()]
        called.clear()
        for key, _ in store.acquire(absent[:2], while_waiting):  # landed by now: nothing to wait for
            store.release([key])
        assert called == []


def test_a_routing_trace_that_cannot_be_used_is_reported(reference, tmp_path, caplog):
    """--trace with nothing to read ahead (every unit resident, or prefetching off) says so instead of being
    silently ignored."""
    path = reference[0]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"steps": []}))
    for kw, why in (({"prefetch": True}, "every unit is resident"),
                    ({"prefetch": False, "budget": Budget(ram="25%")}, "prefetching is off")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="offload_engine"):
            Engine.open(path, max_context=32, trace=str(trace), **kw).close()
        assert any(str(trace) in r.getMessage() and why in r.getMessage() for r in caplog.records), why


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3", "qwen3_next"])
def test_route_ahead_is_lossless_on_every_moe_family(checkpoint_factory, arch):
    """Shared experts (computed early, in the wait, and added once), dense first layers (never predicted),
    sigmoid-scored group routing and hybrid linear attention: route ahead changes no token."""
    path = checkpoint_factory(arch, "offload")
    with Engine.open(path, max_context=64) as engine:
        expected = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True).token_ids
    config = PrefetchConfig(adaptive=False, reads=0, route_ahead=2)
    with Engine.open(path, budget=Budget(ram="25%"), max_context=64, prefetch=config, direct_io="off",
                     read_fn=SlowReads(0.003)) as engine:
        completion = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    assert completion.token_ids == expected
    assert completion.stats["expert_reads"]["demand"] > 0  # experts streamed: layers waited
    assert completion.stats["prefetch"]["route_ahead"]["precision"] > 0  # and predicted in their waits
