"""Concurrent requests on one engine (RELIABILITY 6: C3; issue 9 item 6).

The engine serializes requests with one lock (documented in offload_engine.api: one KV cache and one weight
store per engine). N threads released together by a Barrier send different requests (greedy and seeded
sampling, generate / stream / logits) to one streaming engine; every result must equal what the same request
gives when the requests run one after another, and no two forwards may ever run at the same time (no mixed
state). Closing the engine while requests are in flight ends each of them with its result or a clear
EngineClosedError, and nothing hangs.

OFFLOAD_ENGINE_CONCURRENCY_ROUNDS sets the rounds (default 20; the release gate uses 100).
"""
from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from offload_engine import Budget, Engine, EngineClosedError
from offload_engine.generate.decoder import FinishEvent
from tests.figures import Figures

N = 8
ROUNDS = int(os.environ.get("OFFLOAD_ENGINE_CONCURRENCY_ROUNDS", 20))
CONTEXT = 64
NEW = 3
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8], [300, 301, 7, 7, 7, 9],
           [64, 128, 33, 2, 77, 101, 9, 200], [400, 12, 13, 250, 250, 1], [9, 8, 7, 6, 5, 4, 3, 2, 1],
           [100, 200, 300, 400], [42] * 6]
SAMPLING = [dict(), dict(temperature=0.8, seed=1), dict(temperature=1.0, top_k=20, seed=7), dict(),
            dict(temperature=0.7, top_p=0.9, seed=3), dict(), dict(temperature=1.2, min_p=0.05, seed=11), dict()]
FIGURES = Figures("concurrency")
report_figures = FIGURES.fixture()
tally = FIGURES.tally



class ForwardGuard:
    """Wraps model.forward: counts how many run at once (must never exceed 1)."""

    def __init__(self, model):
        self.model, self.inner = model, model.forward
        self.lock, self.active, self.most, self.calls = threading.Lock(), 0, 0, 0
        model.forward = self

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.active += 1
            self.calls += 1
            self.most = max(self.most, self.active)
        try:
            time.sleep(0)  # yield the GIL: give an overlapping request every chance to run
            return self.inner(*args, **kwargs)
        finally:
            with self.lock:
                self.active -= 1


def request(engine: Engine, i: int, how: str):
    if how == "logits":
        return engine.logits(PROMPTS[i])
    if how == "stream":
        finish = [e for e in engine.stream(PROMPTS[i], max_new_tokens=NEW, ignore_eos=True, **SAMPLING[i])
                  if isinstance(e, FinishEvent)]
        return finish[0].token_ids
    return engine.generate(PROMPTS[i], max_new_tokens=NEW, ignore_eos=True, **SAMPLING[i]).token_ids


def same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.fixture(scope="module")
def engine(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off") as engine:
        yield engine


@pytest.fixture(scope="module")
def sequential(engine):
    """Each request alone, one after another: the expected results."""
    return {(i, how): request(engine, i, how) for i in range(N) for how in ("generate", "logits")}


def test_concurrent_requests_are_serialized_and_match_sequential(engine, sequential):
    guard = ForwardGuard(engine.model)
    rng = random.Random(3)
    mismatches, requests = [], 0
    try:
        with ThreadPoolExecutor(N) as pool:
            for rnd in range(ROUNDS):
                barrier = threading.Barrier(N, timeout=30)
                jobs = [(i, rng.choice(["generate", "generate", "stream", "logits"])) for i in rng.sample(range(N), N)]

                def run(job):
                    barrier.wait()
                    return request(engine, *job)

                results = list(pool.map(run, jobs, timeout=120))
                for (i, how), got in zip(jobs, results):
                    requests += 1
                    want = sequential[(i, "logits" if how == "logits" else "generate")]
                    if not same(got, want):
                        mismatches.append((rnd, i, how))
    finally:
        engine.model.forward = guard.inner
    tally("rounds", ROUNDS)
    tally("concurrent_requests", requests)
    tally("mixed_outputs", len(mismatches))
    assert not mismatches, f"{len(mismatches)} results differ from the sequential run: {mismatches[:5]}"
    assert guard.most == 1, f"{guard.most} forwards ran at the same time on one engine"
    assert guard.calls >= ROUNDS * N


def test_request_stats_are_per_request_under_concurrency(engine):
    """Stats are deltas over each request alone: concurrent requests do not leak into each other's figures."""
    barrier = threading.Barrier(N, timeout=30)

    def run(i):
        barrier.wait()
        return engine.generate(PROMPTS[i], max_new_tokens=NEW, ignore_eos=True).stats

    with ThreadPoolExecutor(N) as pool:
        stats = list(pool.map(run, range(N), timeout=120))
    for s in stats:
        assert s["generated_tokens"] == NEW
        assert s["prompt_tokens"] in {len(p) for p in PROMPTS}
        assert s["peak_bytes"]["host"] <= s["budget_bytes"]["host"]


def test_close_while_requests_are_in_flight(checkpoint_factory, sequential):
    path = checkpoint_factory("qwen3_moe", "offload")
    threads = threading.active_count()
    engine = Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io="off")
    barrier = threading.Barrier(N + 1, timeout=30)
    outcomes: list = []

    def run(i):
        barrier.wait()
        for _ in range(50):
            try:
                got = engine.generate(PROMPTS[i], max_new_tokens=NEW, ignore_eos=True, **SAMPLING[i]).token_ids
            except EngineClosedError:
                outcomes.append("closed")
                return
            except BaseException as e:  # noqa: BLE001
                outcomes.append(e)
                return
            outcomes.append("ok" if got == sequential[(i, "generate")] else ("mismatch", i))

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(N)]
    for w in workers:
        w.start()
    barrier.wait()
    time.sleep(0.5)
    engine.close()  # waits for the request in progress, then every later request is refused
    for w in workers:
        w.join(30)
    assert not any(w.is_alive() for w in workers), "a request hung after close()"
    bad = [o for o in outcomes if o not in ("ok", "closed")]
    assert not bad, bad[:5]
    assert outcomes.count("closed") == N
    deadline = time.monotonic() + 3
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threading.active_count() == threads
