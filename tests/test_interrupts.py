"""Ctrl-C never strands a standard-library lock (offload_engine/interrupts.py).

Python raises KeyboardInterrupt at the next bytecode boundary, which can be right after `Condition.__enter__`
took its lock (every `queue.Queue.put`, `Event.set`) or between the futures' locks `concurrent.futures.wait`
takes: that lock is never released and the next taker hangs (how the CLI once hung after a SIGINT, and left its
reader threads blocked). Here the main thread loops over exactly those calls while a timer thread interrupts it
(`_thread.interrupt_main`, which runs the installed SIGINT handler as a real signal does); afterwards every lock
must be free. The same loop under Python's default handler shows the test can see a stranded lock.
"""
from __future__ import annotations

import _thread
import queue
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import pytest

from offload_engine.interrupts import SafeInterrupts, in_lock_handling, sigint_guarded
from tests.figures import write_line

TRIALS = 200
main_only = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                               reason="signal handlers live on the main thread")


def free(lock) -> bool:
    """Whether another thread can take `lock` (an RLock held by this thread would pass a test from here)."""
    box = []
    t = threading.Thread(target=lambda: box.append(lock.acquire(timeout=0.2) and (lock.release() or True)))
    t.start()
    t.join()
    return box == [True]


def cycle(q: queue.Queue, event: threading.Event, fut: Future) -> None:
    """The stdlib calls the reader pool makes from the main thread (a Python function, as the engine's are)."""
    q.put((1, 0))
    q.get_nowait()
    event.set()
    event.clear()
    wait([fut], timeout=0.1, return_when=FIRST_COMPLETED)


def interrupt_once(delay: float) -> threading.Thread:
    """A thread that interrupts the main thread `delay` s after this returns (never while it is still starting
    the thread: an interrupt stranding the thread's own start-up lock would hang the test itself)."""
    go = threading.Event()

    def fire() -> None:
        go.wait()
        time.sleep(delay)
        _thread.interrupt_main()

    thread = threading.Thread(target=fire)
    thread.start()
    go.set()
    return thread


def stranded_locks(guarded: bool, trials: int = TRIALS) -> tuple[int, int]:
    """(interrupts delivered, trials that left a lock held) while the main thread loops over `cycle`."""
    delivered = stranded = 0
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for trial in range(trials):
            q, event, fut = queue.PriorityQueue(), threading.Event(), Future()
            fut.set_result(None)
            guard = SafeInterrupts() if guarded else None
            interrupter = interrupt_once(0.001 + (trial % 9) * 0.0002)
            try:
                try:
                    while True:
                        cycle(q, event, fut)
                finally:
                    if guard is not None:
                        guard.restore()
            except KeyboardInterrupt:
                delivered += 1
            interrupter.join()
            if not (free(q.mutex) and free(event._cond._lock) and free(fut._condition)):
                stranded += 1
    finally:
        signal.signal(signal.SIGINT, previous)
    return delivered, stranded


@main_only
def test_safe_interrupts_never_strand_a_stdlib_lock(request):
    delivered, stranded = stranded_locks(guarded=True)
    plain_delivered, plain_stranded = stranded_locks(guarded=False)
    write_line(request, f"interrupts in stdlib lock handling: {stranded}/{delivered} stranded a lock with "
                        f"SafeInterrupts, {plain_stranded}/{plain_delivered} with Python's default handler")
    assert delivered == TRIALS and stranded == 0
    assert plain_stranded > 0  # the loop does hit the window: the guarded result above means something


@main_only
def test_restore_raises_a_pending_interrupt_and_puts_everything_back():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        guard = SafeInterrupts()
        assert signal.getsignal(signal.SIGINT) != signal.default_int_handler
        interrupter = interrupt_once(0.05)  # the main thread is then waiting inside threading's code
        threading.Event().wait(0.3)  # handled inside threading's frames: deferred
        pending = sys.getprofile() is not None  # (C calls from here: nothing lands on them)
        raised = False
        try:
            guard.restore()  # the first Python call: this module's own, which raises it after restoring
        except KeyboardInterrupt:
            raised = True
        interrupter.join()
        assert pending and raised
        assert sys.getprofile() is None
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@main_only
def test_a_deferred_interrupt_lands_at_the_first_python_call_outside_lock_handling():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached = []

    def mark(what: str) -> None:
        reached.append(what)

    try:
        guard = SafeInterrupts()
        interrupter = interrupt_once(0.05)  # the main thread is then waiting inside threading's code
        try:
            threading.Event().wait(0.3)  # deferred: the interrupt arrives inside the wait
            reached.append("C calls do not take it")
            mark("the first Python call does")
        except KeyboardInterrupt:
            pass
        finally:
            guard.restore()  # nothing pending any more: no raise
        interrupter.join()
        assert reached == ["C calls do not take it"]
        assert sys.getprofile() is None
    finally:
        signal.signal(signal.SIGINT, previous)


@main_only
def test_a_second_interrupt_while_one_is_pending_makes_one_keyboard_interrupt():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    calls = []

    def call() -> None:
        calls.append(len(calls))

    try:
        guard = SafeInterrupts()
        interrupter = interrupt_once(0.05)
        threading.Event().wait(0.3)  # the first: deferred
        pending = sys.getprofile() is not None
        raised = 0
        try:
            _thread.interrupt_main()  # the second, while the first is pending
            call()
        except KeyboardInterrupt:
            raised += 1
        call()  # nothing left pending
        guard.restore()
        interrupter.join()
        assert pending and raised == 1 and calls == [0] and sys.getprofile() is None
    finally:
        signal.signal(signal.SIGINT, previous)


@main_only
def test_sigint_guarded_installs_only_over_python_default_handling():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigint_guarded():
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

        def own(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, own)
        with sigint_guarded():  # the caller's own handler is left alone
            assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)


def test_lock_handling_is_found_anywhere_on_the_stack():
    frames = {}

    def inner():
        frames["inner"] = sys._getframe()

    inner()
    assert not in_lock_handling(frames["inner"])
    t = threading.Thread(target=lambda: frames.__setitem__("thread", sys._getframe()))
    t.start()
    t.join()
    assert in_lock_handling(frames["thread"])  # threading's bootstrap frames are its callers
