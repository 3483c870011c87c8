"""Engine lifecycle (RELIABILITY 6: C2, C4; issue 9 item 5, API side).

close() is idempotent; use after close is a clear EngineClosedError; closing (or dropping) an engine leaves no
reader thread and no file descriptor behind; a KeyboardInterrupt delivered to the main thread while it generates
or opens (`_thread.interrupt_main()` from a timer: what Ctrl-C does to a Python program) propagates promptly and
leaves the engine usable, serving bitwise what a clean engine serves.

OFFLOAD_ENGINE_INTERRUPT_TRIALS sets the number of interrupt trials per phase (default 16).
"""
from __future__ import annotations

import _thread
import gc
import os
import random
import threading
import time

import pytest
import torch

from offload_engine import Budget, Engine, EngineClosedError, OffloadEngineError
from offload_engine.generate.decoder import FinishEvent, TokenEvent
from offload_engine.store.disk import read_range
from tests.figures import Figures

CONTEXT = 64
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
OTHER = [64, 128, 33, 2, 77, 101, 9, 200, 14, 15]
NEW = 4
TRIALS = int(os.environ.get("OFFLOAD_ENGINE_INTERRUPT_TRIALS", 16))
FIGURES = Figures("lifecycle")
report_figures = FIGURES.fixture()
tally = FIGURES.tally


@pytest.fixture(scope="module", autouse=True)
def sigint_raises():
    """interrupt_main() simulates SIGINT, which does nothing where SIGINT is ignored (a background job of a
    non-interactive shell, some CI runners): install Python's default handler for these tests."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)




def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settle(threads: int, fds: int, timeout: float = 3.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (threading.active_count() > threads or open_fds() > fds):
        time.sleep(0.02)
    return threading.active_count(), open_fds()


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", "offload")
    with Engine.open(path, max_context=CONTEXT) as engine:
        ref = {"logits": engine.logits(PROMPT), "other": engine.logits(OTHER),
               "tokens": engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids}
    return path, ref


def streaming(path, direct_io="off", **kw) -> Engine:
    return Engine.open(path, budget=Budget(ram="10%"), max_context=CONTEXT, direct_io=direct_io, **kw)


# ---- C4: close ------------------------------------------------------------------------------------------------

def test_close_is_idempotent_and_use_after_close_is_a_clear_error(model):
    path, ref = model
    engine = streaming(path)
    pending = engine.stream(PROMPT, max_new_tokens=NEW)  # created, never started
    assert engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids == ref["tokens"]
    engine.close()
    engine.close()
    with engine:  # __exit__ closes once more
        pass
    for call in (lambda: engine.generate(PROMPT, max_new_tokens=NEW), lambda: engine.logits(PROMPT),
                 lambda: next(engine.stream(PROMPT, max_new_tokens=NEW)), lambda: next(pending)):
        with pytest.raises(EngineClosedError, match="closed") as err:
            call()
        assert isinstance(err.value, OffloadEngineError) and "Engine.open" in str(err.value)
        tally("use_after_close_errors")


@pytest.mark.parametrize("direct_io", ["off", "on"])
@pytest.mark.parametrize("ram", [None, "10%", "25%"])
def test_close_leaves_no_thread_and_no_descriptor(model, direct_io, ram):
    path, ref = model
    gc.collect()  # engines an earlier failing test left open go first
    threads, fds = threading.active_count(), open_fds()
    with Engine.open(path, budget=Budget(ram=ram), max_context=CONTEXT, direct_io=direct_io) as engine:
        assert engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids == ref["tokens"]
        pool = engine.store.pool
        assert len(pool.threads_alive()) == pool.threads
    assert not pool.threads_alive() and not pool.unjoined
    now_threads, now_fds = settle(threads, fds)
    assert now_threads <= threads and now_fds <= fds, (now_threads, threads, now_fds, fds)


@pytest.mark.parametrize("direct_io", ["off", "on"])
def test_engine_dropped_without_close_leaks_nothing(model, direct_io):
    """GC without close (C4): the reader threads stop and every shard descriptor (O_DIRECT ones included) is
    closed when the engine is collected."""
    path, ref = model
    gc.collect()
    threads, fds = threading.active_count(), open_fds()
    engine = streaming(path, direct_io)
    assert engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids == ref["tokens"]
    del engine
    gc.collect()
    now_threads, now_fds = settle(threads, fds)
    assert now_threads <= threads, [t.name for t in threading.enumerate()]
    assert now_fds <= fds, f"{now_fds - fds} descriptor(s) leaked by an engine dropped without close()"


def test_close_from_the_thread_iterating_a_stream_does_not_deadlock(model):
    """`it = engine.stream(...); next(it); engine.close()` in one thread (or leaving `with Engine.open()` with the
    stream still referenced): the suspended stream holds the engine lock. close() must not wait for it forever:
    it should end that stream (or fail fast with a clear error)."""
    path, _ = model
    engine = streaming(path)
    box: dict = {}

    def user_code():
        try:
            box["stream"] = engine.stream(PROMPT, max_new_tokens=NEW, ignore_eos=True)
            next(box["stream"])
            engine.close()
            box["result"] = "closed"
        except BaseException as e:  # noqa: BLE001
            box["result"] = e

    t = threading.Thread(target=user_code, daemon=True)
    t.start()
    t.join(5.0)
    hung = t.is_alive()
    if hung:  # unblock it: closing the suspended generator from here releases the engine lock
        box["stream"].close()
        t.join(5.0)
    engine.close()
    assert not hung, "close() deadlocked on a stream suspended in the same thread"
    assert box["result"] == "closed" or isinstance(box["result"], OffloadEngineError), box["result"]


def test_second_stream_in_the_same_thread_does_not_deadlock(model):
    """zip(engine.stream(a), engine.stream(b)) in one thread: the second stream waits on the lock the first holds.
    Expected: a clear error (serialized engine, documented) instead of a hang."""
    path, _ = model
    engine = streaming(path)
    box: dict = {}

    def user_code():
        try:
            box["a"] = engine.stream(PROMPT, max_new_tokens=NEW, ignore_eos=True)
            next(box["a"])
            next(engine.stream(OTHER, max_new_tokens=NEW, ignore_eos=True))
            box["result"] = "ran"
        except BaseException as e:  # noqa: BLE001
            box["result"] = e

    t = threading.Thread(target=user_code, daemon=True)
    t.start()
    t.join(5.0)
    hung = t.is_alive()
    box["a"].close()  # the abandoned first stream holds the lock: end it (close() from here would wait for it)
    t.join(10.0)
    engine.close()
    assert not hung, "a second stream() in the thread that holds the first one deadlocked"
    assert isinstance(box["result"], OffloadEngineError), box["result"]


# ---- C2: KeyboardInterrupt in the API ------------------------------------------------------------------------

def interrupt_after(delay: float, fn):
    """Run fn() in the main thread and interrupt it (like Ctrl-C) after `delay` seconds. The interrupt always
    lands inside this function: ('interrupted', None), ('completed', fn()) when the timer did not fire in time, or
    ('late', fn()) when it fired after fn returned."""
    fired = threading.Event()
    box = {}

    def fire():
        fired.set()
        _thread.interrupt_main()

    timer = threading.Timer(delay, fire)
    try:
        timer.start()
        box["result"] = fn()
        timer.cancel()
        timer.join()
        if fired.is_set():
            time.sleep(1.0)  # the pending interrupt is delivered here
        return "completed", box["result"]
    except KeyboardInterrupt:
        timer.cancel()
        timer.join()
        return ("late", box["result"]) if "result" in box else ("interrupted", None)


def assert_idle(engine: Engine) -> None:
    """Between requests: no unit is still acquired, and no slot waits on a read that will never finish."""
    store = engine.store
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        slots = store.slot_states()
        loading = [s for s in slots if s.reading]
        if not loading:
            break
        time.sleep(0.02)
    assert not loading, [(s.tier, s.key) for s in loading]
    held = [(s.tier, str(s.key), s.refs) for s in slots if s.refs]
    assert not held, f"units still acquired after an interrupted request: {held}"


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_keyboard_interrupt_during_generate_leaves_engine_usable(model):
    path, ref = model
    rng = random.Random(11)
    threads, fds = threading.active_count(), open_fds()

    throttle = {"on": True}

    def slow_read(files, r, blob):  # reads in flight whenever the interrupt lands
        if throttle["on"]:
            time.sleep(0.002)
        read_range(files, r, blob)

    engine = streaming(path, read_fn=slow_read)
    spans = []
    for _ in range(3):
        t0 = time.monotonic()
        engine.generate(OTHER, max_new_tokens=NEW, ignore_eos=True)
        spans.append(time.monotonic() - t0)
    span = max(min(spans), 0.05)
    interrupted = 0
    for trial in range(TRIALS):
        prompt = PROMPT if trial % 2 else OTHER
        start = time.monotonic()
        throttle["on"] = True
        outcome, _ = interrupt_after(rng.uniform(0, 0.9 * span),
                                     lambda: engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True))
        throttle["on"] = False
        if outcome == "interrupted":
            interrupted += 1
            assert time.monotonic() - start < span + 2.0
        # usable, and bitwise what a clean engine serves
        assert engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids == ref["tokens"], trial
        assert_idle(engine)  # after a complete request nothing is left acquired (the interrupted one's refs too)
        if trial % 4 == 0:
            assert torch.equal(engine.logits(OTHER), ref["other"]), trial
    engine.close()
    tally("keyboard_interrupts_generate", interrupted)
    assert interrupted >= TRIALS // 2
    now_threads, now_fds = settle(threads, fds)
    assert now_threads <= threads and now_fds <= fds, (now_threads, threads, now_fds, fds)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_keyboard_interrupt_during_stream_consumer(model):
    """Ctrl-C while the caller consumes a stream (between tokens): the stream is abandoned, the lock is free."""
    path, ref = model
    engine = streaming(path)

    def consume():
        for event in engine.stream(PROMPT, max_new_tokens=NEW, ignore_eos=True):
            if isinstance(event, TokenEvent):
                time.sleep(0.5)  # the consumer is slow: the interrupt lands in user code
            assert not isinstance(event, FinishEvent) or event.token_ids == ref["tokens"]

    rng = random.Random(2)
    for _ in range(5):
        outcome, _ = interrupt_after(rng.uniform(0.05, 0.6), consume)
        assert outcome == "interrupted"
        tally("keyboard_interrupts_stream")
        assert engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids == ref["tokens"]
        assert_idle(engine)
    engine.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_keyboard_interrupt_during_open_leaves_nothing_behind(model):
    path, ref = model
    rng = random.Random(5)

    def slow_read(files, r, blob):  # loading lasts long enough to be hit
        time.sleep(0.01)
        read_range(files, r, blob)

    threads, fds = threading.active_count(), open_fds()
    spans = []
    for _ in range(2):  # the shorter of two: a worker's first open also pays one-time costs (imports, page cache)
        t0 = time.monotonic()
        Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, direct_io="off", read_fn=slow_read).close()
        spans.append(time.monotonic() - t0)
    span = min(spans)
    interrupted = 0
    for _ in range(max(4, TRIALS // 2)):
        box = {}

        def open_it():
            box["engine"] = Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, direct_io="off",
                                        read_fn=slow_read)

        outcome, _ = interrupt_after(rng.uniform(0, 0.9 * span), open_it)
        if "engine" in box:
            box.pop("engine").close()
        else:
            assert outcome == "interrupted"
            interrupted += 1
        now_threads, now_fds = settle(threads, fds)
    assert now_threads <= threads and now_fds <= fds, (now_threads, threads, now_fds, fds)
    tally("keyboard_interrupts_open", interrupted)
    assert interrupted >= 2
    with Engine.open(path, budget=Budget(ram="25%"), max_context=CONTEXT, direct_io="off") as engine:
        assert torch.equal(engine.logits(PROMPT), ref["logits"])
