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

Start-up: a program (the CLI) first calls `exit_at_once_on_sigint`: until its command starts making things
(files, threads, child processes), Ctrl-C ends the process at once, status 130, without a traceback. Its imports
(torch: seconds) are the time this covers, and there a KeyboardInterrupt would not do: torch's C++ init drops
one raised in the numpy import it makes, and the command then runs to its end. It also takes SIGINT back from
SIG_IGN, which a non-interactive shell gives its background jobs (`offload-engine run ... &`).

Processes: where a library runs a tree of processes this code holds no handle of (torch's extension builder runs
ninja, which runs a compiler per source), a Ctrl-C makes Python kill the library's child outright and its own
children run on, orphaned; `ending_stray_processes` ends them.

Cleanup: a KeyboardInterrupt inside a close() that is joining reader threads would leave threads and
descriptors behind. Cleanup paths run their (idempotent) close through `finish_despite_interrupts`, which reruns
it until it completes and then re-raises the interrupt, so the request still ends with KeyboardInterrupt (exit
status 130 in the CLI). Under `SafeInterrupts` this module's frames count as lock handling, so a close run
through it is not interrupted at all: the interrupt lands right after it.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
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


def exit_at_once_on_sigint() -> None:
    """From now on Ctrl-C ends the process at once with status 130 (start-up: nothing to clean up yet). A
    `SafeInterrupts` installed later takes over, and puts this back when restored. Main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_now)


def _exit_now(signum: int, frame: FrameType | None) -> None:
    for stream in (sys.stdout, sys.stderr):  # what was printed stays printed
        try:
            stream.flush()
        except Exception:  # a closed stream, or one this signal interrupted mid-write (reentrant call)
            pass
    try:
        os.write(2, b"\ninterrupted\n")
    except OSError:
        pass
    os._exit(130)


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


PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphaned descendants are reparented to this process, not to init
STRAY_GRACE_S = 1.0  # SIGTERM, then SIGKILL


@contextmanager
def ending_stray_processes() -> Iterator[None]:
    """For a block that runs a library's child processes, which start their own (ninja, then compilers): while it
    runs, this process adopts their orphans (PR_SET_CHILD_SUBREAPER, Linux); when the block raises (a Ctrl-C makes
    Python SIGKILL the library's child, its compilers run on), every child of this process that the block started
    or adopted is ended with its process group (ninja starts each job in a group of its own), then reaped."""
    before = set(_children())
    adopting = _subreaper(True)
    try:
        yield
    except BaseException:
        finish_despite_interrupts(lambda: _end_children(before))
        raise
    finally:
        if adopting:
            _subreaper(False)


def _subreaper(on: bool) -> bool:
    """prctl(PR_SET_CHILD_SUBREAPER); whether it took (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # here: the CLI imports this module before it takes Ctrl-C over, and ctypes is not needed there

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    zero = ctypes.c_ulong(0)
    return prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(int(on)), zero, zero, zero) == 0


def _children() -> list[int]:
    """This process's children (zombies included), from /proc."""
    me, found = os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in filter(str.isdigit, names):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        if len(fields) > 1 and int(fields[1]) == me:
            found.append(int(name))
    return found


def _end_children(keep: set[int]) -> None:
    """SIGTERM to each child not in `keep` (its process group where it leads one), SIGKILL after STRAY_GRACE_S,
    each reaped; repeated while killing a child hands its own children (orphans) to this process."""
    deadline = time.monotonic() + STRAY_GRACE_S
    signalled: set[int] = set()
    while (strays := [pid for pid in _children() if pid not in keep]) and time.monotonic() < deadline + 1:
        late = time.monotonic() > deadline
        for pid in strays:
            if pid not in signalled or late:
                _signal_group(pid, signal.SIGKILL if late else signal.SIGTERM)
                signalled.add(pid)
            try:
                os.waitpid(pid, 0 if late else os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.005)


def _signal_group(pid: int, sig: int) -> None:
    try:
        group = os.getpgid(pid)
        if group == pid and group != os.getpgrp():
            os.killpg(group, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


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
