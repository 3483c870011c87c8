"""Ctrl-C without stranded locks, and cleanup that a Ctrl-C cannot cut short.

Where it lands: Python raises KeyboardInterrupt in the main thread at the next bytecode boundary, wherever that
is, including inside the standard library's own lock handling: right after `threading.Condition.__enter__`
acquired its lock (every `queue.Queue.put`, `Event.set`), between the futures' locks that
`concurrent.futures.wait` takes one by one, in logging's handler lock or tqdm's write lock. That lock is then
never released, and the next thread to take it (a reader thread settling its future, or the main thread
closing the reader pool) blocks forever. `SafeInterrupts` (installed by the CLI for the duration of a command,
and by the API around its own work: `sigint_guarded`) handles SIGINT so that it raises at once where no frame
of such a module is on the main thread's stack, and otherwise when the main thread next starts a Python
function outside them (a profile hook on the main thread, set only while an interrupt is pending). The
standard library's waits are all bounded or short here, so the interrupt still lands within milliseconds; a
loop of bounded waits that makes no other call (a `Thread.join(timeout)` loop) calls `deliver_pending`.

Cleanup: a KeyboardInterrupt inside a close() that is joining reader threads would leave threads and
descriptors behind. Cleanup paths run their (idempotent) close through `finish_despite_interrupts`, which reruns
it until it completes and then re-raises the interrupt, so the request still ends with KeyboardInterrupt (exit
status 130 in the CLI). Under `SafeInterrupts` this module's frames count as lock handling, so a close run
through it is not interrupted at all: the interrupt lands right after it.
"""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Callable, Iterator

MAX_RERUNS = 8  # a user pressing Ctrl-C repeatedly still gets out
INSISTENT_PRESSES = 3  # the third Ctrl-C while one is deferred raises at once: a user insisting gets out

# modules whose frames may hold a lock taken in Python code (or take one next), or whose callbacks swallow
# exceptions (weakref finalizers): an interrupt waits until the main thread is out of them. Matched on the
# module's top-level package (`concurrent` is concurrent.futures).
_LOCK_HANDLING = frozenset({"threading", "queue", "concurrent", "logging", "tqdm", "multiprocessing", "importlib",
                            "_frozen_importlib", "weakref", "_weakrefset"})
_ACTIVE: list["SafeInterrupts"] = []  # the guards installed, innermost last (deliver_pending)


def finish_despite_interrupts(close: Callable[[], object]) -> None:
    interrupted = False
    for _ in range(MAX_RERUNS):
        try:
            close()
            break
        except KeyboardInterrupt:
            interrupted = True  # close is idempotent: run it again to finish what was cut short
    if interrupted:
        raise KeyboardInterrupt


def in_lock_handling(frame: FrameType | None, outer: frozenset[int] = frozenset()) -> bool:
    """Whether a frame of this stack, up to the first of `outer` (ids of frames already running when a guard was
    installed: its caller's callers do not hold the guard's interrupts), runs in a module that handles locks in
    Python code (or this module), or is a `__del__` (an exception raised there is printed and dropped)."""
    while frame is not None and id(frame) not in outer:
        if _handles_locks(frame):
            return True
        frame = frame.f_back
    return False


def _handles_locks(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return name == __name__ or name.partition(".")[0] in _LOCK_HANDLING or frame.f_code.co_name == "__del__"


def deliver_pending() -> None:
    """Raise a Ctrl-C the innermost guard deferred. For loops of bounded waits inside the standard library
    (`Thread.join(timeout)`) that make no other Python call between them: the profile hook only delivers at one."""
    if _ACTIVE and _ACTIVE[-1]._presses:
        _ACTIVE[-1]._stop_pending()
        raise KeyboardInterrupt


class SafeInterrupts:
    """While installed, SIGINT raises KeyboardInterrupt in the main thread, even when the process started with
    SIGINT ignored (a background job of a non-interactive shell, some CI runners), but never inside the
    standard library's lock handling (see the module's docstring). `restore()` puts the previous handler back
    and raises an interrupt that was still pending. Only the main thread can install handlers: elsewhere this
    does nothing. Raised at once all the same: the third Ctrl-C while one is deferred, and any Ctrl-C while
    someone else's profiler (cProfile) runs, which the deferring hook would displace."""

    def __init__(self) -> None:
        self._installed = threading.current_thread() is threading.main_thread()
        self._presses = 0  # Ctrl-Cs deferred and not raised yet
        if self._installed:
            # held until restore(): a frame that returns meanwhile (a context manager's __enter__) must not free
            # its id for a new frame, which the stack walks would then take for an outer one
            self._outer_frames, frame = [], sys._getframe(1)
            while frame is not None:
                self._outer_frames.append(frame)
                frame = frame.f_back
            self._outer = frozenset(map(id, self._outer_frames))
            self._previous_handler = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_sigint)
            _ACTIVE.append(self)

    @property
    def pending(self) -> int:
        """Ctrl-Cs deferred and not raised yet."""
        return self._presses

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        profile = sys.getprofile()
        if (not in_lock_handling(frame, self._outer) or self._presses + 1 >= INSISTENT_PRESSES
                or (profile is not None and profile != self._deliver)):
            self._stop_pending()  # one KeyboardInterrupt for every press so far
            raise KeyboardInterrupt
        self._presses += 1
        if self._presses == 1:  # delivered at the main thread's next call from outside lock handling
            sys.setprofile(self._deliver)

    def _deliver(self, frame: FrameType, event: str, arg: object) -> None:
        """Raise the pending interrupt as a Python function starts, where neither it nor its callers handle
        locks: a place where Python itself may raise one. Never at a "c_call": that may be a lock's release."""
        if event == "call" and not in_lock_handling(frame, self._outer):
            self._stop_pending()
            raise KeyboardInterrupt

    def _stop_pending(self) -> None:
        if self._presses:
            sys.setprofile(None)  # first: a signal landing in between cannot arm the hook again
            self._presses = 0

    def restore(self) -> None:
        if not self._installed:
            return
        self._installed = False
        pending = self._presses > 0
        try:
            previous = self._previous_handler
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        finally:
            self._stop_pending()
            _ACTIVE.remove(self)
            self._outer_frames, self._outer = [], frozenset()
        if pending:
            raise KeyboardInterrupt


@contextmanager
def sigint_guarded() -> Iterator[None]:
    """`SafeInterrupts` for a block of engine work (the Python API), where the caller runs Python's default Ctrl-C
    handling on the main thread (a REPL, a script); a handler of the caller's own (the CLI's) is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    guard = SafeInterrupts()
    try:
        yield
    finally:
        guard.restore()
