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
import cProfile
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import pytest

from offload_engine.interrupts import (SafeInterrupts, deliver_pending, ending_stray_processes, in_lock_handling,
                                       sigint_guarded)
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


class Interrupter:
    """A thread that interrupts the main thread `delay` s after it starts (never while the main thread is still
    starting it: an interrupt stranding the thread's own start-up lock would hang the test itself). `fired` is
    set right after the interrupt: a test waits on it (inside threading's code, so a guard defers the
    interrupt) rather than for a fixed time a slow machine could overrun."""

    def __init__(self, delay: float, presses: int = 1):
        self.fired, go = threading.Event(), threading.Event()

        def fire() -> None:
            go.wait()
            for _ in range(presses):
                time.sleep(delay)
                if presses == 1:
                    _thread.interrupt_main()
                else:  # a real signal: it wakes the main thread's wait, so each press is handled on its own
                    os.kill(os.getpid(), signal.SIGINT)
            self.fired.set()

        self.thread = threading.Thread(target=fire)
        self.thread.start()
        go.set()

    def wait(self) -> None:
        assert self.fired.wait(10), "the interrupter never fired"


@pytest.fixture
def default_handling():
    """Python's default SIGINT handling for the test (SIGINT may be ignored where the suite runs)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def stranded_locks(guarded: bool, trials: int = TRIALS) -> tuple[int, int]:
    """(interrupts delivered, trials that left a lock held) while the main thread loops over `cycle`."""
    delivered = stranded = 0
    for trial in range(trials):
        q, event, fut = queue.PriorityQueue(), threading.Event(), Future()
        fut.set_result(None)
        guard = SafeInterrupts() if guarded else None
        interrupter = Interrupter(0.001 + (trial % 9) * 0.0002)
        try:
            try:
                deadline = time.monotonic() + 10  # a lost interrupt fails the count, never hangs the test
                while time.monotonic() < deadline:
                    cycle(q, event, fut)
            finally:
                if guard is not None:
                    guard.restore()
        except KeyboardInterrupt:
            delivered += 1
        interrupter.thread.join()
        if not (free(q.mutex) and free(event._cond._lock) and free(fut._condition)):
            stranded += 1
    return delivered, stranded


@main_only
def test_safe_interrupts_never_strand_a_stdlib_lock(request, default_handling):
    delivered, stranded = stranded_locks(guarded=True)
    plain_delivered = plain_stranded = 0
    for _ in range(3):  # the loop does hit the window (37 of 200 here): the guarded result means something
        more_delivered, more_stranded = stranded_locks(guarded=False)
        plain_delivered, plain_stranded = plain_delivered + more_delivered, plain_stranded + more_stranded
        if plain_stranded:
            break
    write_line(request, f"interrupts in stdlib lock handling: {stranded}/{delivered} stranded a lock with "
                        f"SafeInterrupts, {plain_stranded}/{plain_delivered} with Python's default handler")
    assert delivered == TRIALS and stranded == 0
    assert plain_stranded > 0


def deferred(guard: SafeInterrupts) -> bool:
    """One interrupt, fired while the main thread waits inside threading's code: whether the guard deferred it."""
    interrupter = Interrupter(0.02)
    interrupter.wait()
    interrupter.thread.join()
    return guard.pending > 0 and sys.getprofile() is not None


@main_only
def test_restore_raises_a_pending_interrupt_and_puts_everything_back(default_handling):
    guard = SafeInterrupts()
    assert signal.getsignal(signal.SIGINT) != signal.default_int_handler
    pending = deferred(guard)
    raised = False
    try:
        guard.restore()  # the first Python call: this module's own, which raises it after restoring
    except KeyboardInterrupt:
        raised = True
    assert pending and raised
    assert sys.getprofile() is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@main_only
def test_a_deferred_interrupt_lands_at_the_first_python_call_outside_lock_handling(default_handling):
    reached = []

    def mark(what: str) -> None:
        reached.append(what)

    guard = SafeInterrupts()
    try:
        assert deferred(guard)
        reached.append("C calls do not take it")
        mark("the first Python call does")
    except KeyboardInterrupt:
        pass
    finally:
        guard.restore()  # nothing pending any more: no raise
    assert reached == ["C calls do not take it"]
    assert sys.getprofile() is None


@main_only
def test_a_second_interrupt_while_one_is_pending_makes_one_keyboard_interrupt(default_handling):
    calls = []

    def call() -> None:
        calls.append(len(calls))

    guard = SafeInterrupts()
    pending = deferred(guard)
    raised = 0
    try:
        _thread.interrupt_main()  # the second, while the first is pending
        call()
    except KeyboardInterrupt:
        raised += 1
    call()  # nothing left pending
    guard.restore()
    assert pending and raised == 1 and calls == [0] and sys.getprofile() is None


@main_only
def test_the_third_press_raises_at_once(default_handling):
    guard = SafeInterrupts()
    try:
        with pytest.raises(KeyboardInterrupt):
            Interrupter(0.05, presses=3).wait()  # all three land in the wait, inside threading's code
        assert guard.pending == 0 and sys.getprofile() is None
    finally:
        guard.restore()


@main_only
def test_another_profiler_is_left_alone(default_handling):
    """With a profiler of someone else's running (cProfile), the deferring hook would displace it: the interrupt
    is raised at once, as without the guard, and the profiler keeps running."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        running = sys.getprofile()
        guard = SafeInterrupts()
        try:
            with pytest.raises(KeyboardInterrupt):
                Interrupter(0.02).wait()
        finally:
            guard.restore()
        assert running is not None and sys.getprofile() is running
    finally:
        profile.disable()


@main_only
def test_deliver_pending_raises_for_loops_of_bounded_waits(default_handling):
    guard = SafeInterrupts()
    try:
        deliver_pending()  # nothing pending: no raise
        assert deferred(guard)
        raised = False
        try:
            deliver_pending()  # (a call of this module's: the hook leaves it to deliver_pending itself)
        except KeyboardInterrupt:
            raised = True
        assert raised and sys.getprofile() is None
    finally:
        guard.restore()


@main_only
def test_frames_running_when_the_guard_was_installed_do_not_defer(default_handling):
    """A guard installed by code that threading's (or multiprocessing's) frames called: those outer frames hold no
    lock of the guarded block, so an interrupt in the block is raised at once."""
    outcome = []

    def guarded_block(_future) -> None:  # called from concurrent.futures' add_done_callback, on this thread
        guard = SafeInterrupts()
        try:
            try:
                _thread.interrupt_main()
                time.sleep(0.2)
                outcome.append("not raised")
            except KeyboardInterrupt:
                outcome.append("raised")
        finally:
            guard.restore()

    done = Future()
    done.set_result(None)
    done.add_done_callback(guarded_block)
    assert outcome == ["raised"]


def test_finalizers_count_as_lock_handling():
    frames = []

    class Finalized:
        def __del__(self):
            frames.append(sys._getframe())

    Finalized()
    assert frames and in_lock_handling(frames[0])  # an exception raised in __del__ would be printed and dropped


@main_only
def test_sigint_guarded_installs_only_over_python_default_handling(default_handling):
    with sigint_guarded():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def own(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, own)  # (the fixture puts the previous handler back)
    with sigint_guarded():  # the caller's own handler is left alone
        assert signal.getsignal(signal.SIGINT) is own


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


def test_exit_at_once_ends_the_process_with_130_and_no_traceback():
    """The CLI's start-up handling (cli.main, before a command makes anything): one line, status 130, at once,
    also where the process started with SIGINT ignored (a background job of a script)."""
    code = ("import os, signal, time\n"
            "from offload_engine.interrupts import exit_at_once_on_sigint\n"
            "exit_at_once_on_sigint()\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n"
            "print('ran on')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 130 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.strip() == "interrupted"


def process_group_members(groups: set[int]) -> list[int]:
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(name)) in groups:
                found.append(int(name))
        except OSError:
            pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_a_block_ended_by_an_interrupt_ends_the_processes_its_library_left():
    """torch's extension builder runs ninja, ninja runs each compiler job in a process group of its own; on a
    Ctrl-C Python SIGKILLs ninja (subprocess.run), and the jobs ran on, orphaned (seen with a native build)."""
    ninja = ("import os, subprocess, sys, time\n"
             "jobs = [subprocess.Popen(['sh', '-c', 'sleep 60; true'], preexec_fn=os.setpgrp) for _ in range(2)]\n"
             "print(' '.join(str(j.pid) for j in jobs), flush=True)\n"
             "time.sleep(60)\n")
    jobs: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        with ending_stray_processes():
            runner = subprocess.Popen([sys.executable, "-c", ninja], stdout=subprocess.PIPE, text=True)
            jobs = [int(pid) for pid in runner.stdout.readline().split()]
            assert len(jobs) == 2 and process_group_members(set(jobs))
            runner.kill()  # what subprocess.run does to its child on a KeyboardInterrupt
            runner.wait()
            runner.stdout.close()
            raise KeyboardInterrupt
    assert not process_group_members(set(jobs))  # each job's shell and its sleep: ended and reaped


def test_a_block_that_completes_leaves_processes_alone():
    with ending_stray_processes():
        kept = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert kept.poll() is None
    finally:
        kept.kill()
        kept.wait()
