"""A pool of reader threads with a priority queue: demand reads (priority 0) jump ahead of prefetches.

Workers never die silently: a read's exception is set on its future and re-raised in the consumer. Every
wait is bounded, shutdown joins every thread within one deadline (a thread stuck in a read that never returns
is reported by what it was reading and left behind as a daemon: it exits as soon as its read returns), and a
stuck read is reported with its file and offset.

Where a read is: `reading(path, offset, nbytes)` records, per thread, the byte range in progress (the disk
readers call it around every system call; the store may call it around a whole read function), so a stall
report names the shard and the offset rather than only the unit.

The stall watchdog (`wait_any`) measures progress, not duration: a stall is declared when no worker of the pool
has finished a system call or a job for the stall timeout. The disk readers read at most READ_CHUNK bytes per
call, so a slow disk that keeps delivering never trips it, however large the unit; a read that never returns
trips it after the timeout, and a warning naming the file and offset comes first (STALL_WARN_S).
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterator

import torch

from ..errors import IOStallError

DEMAND, PREFETCH = 0, 1
CLOSE_TIMEOUT = 1.0  # seconds, for all threads together: close() never waits on a stuck read for longer
STALL_WARN_S = 2.0  # no progress for this long: log a warning naming the file and offset (if below the timeout)

log = logging.getLogger("offload_engine")


@dataclass(frozen=True)
class ReadInProgress:
    """One reader thread's current job: the unit, and the byte range it is reading (when known)."""

    what: str
    path: str | None
    offset: int | None
    nbytes: int | None
    seconds: float  # since the job started

    def __str__(self) -> str:
        where = "" if self.path is None else f" ({self.path} at offset {self.offset}, {self.nbytes} bytes)"
        return f"{self.what}{where} for {self.seconds:.1f}s"


# thread id -> (path, offset, nbytes) of the byte range that thread is reading now
_RANGES: dict[int, tuple[str, int, int]] = {}
# pool worker thread id -> when it last finished a system call or a job (the watchdog's progress signal)
_PROGRESS: dict[int, float] = {}


@contextmanager
def reading(path: str | Path, offset: int, nbytes: int) -> Iterator[None]:
    """Record the byte range this thread is reading for stall reports (nests: the innermost range wins)."""
    me = threading.get_ident()
    outer = _RANGES.get(me)
    _RANGES[me] = (str(path), int(offset), int(nbytes))
    try:
        yield
    finally:
        if me in _PROGRESS:  # pool workers only (other threads do not feed a watchdog)
            _PROGRESS[me] = time.monotonic()
        if outer is None:
            _RANGES.pop(me, None)
        else:
            _RANGES[me] = outer


class BusyClock:
    """Wall time during which at least one reader was reading (the union of the jobs' intervals, not their sum):
    what the store compares with the compute thread's wait to tell how much of the I/O was hidden."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active, self._since, self._total = 0, 0.0, 0.0

    def enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.monotonic()
            self._active += 1

    def exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._total += time.monotonic() - self._since

    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.monotonic() - self._since if self._active else 0.0)

    @property
    def active(self) -> int:
        """Jobs running now (a reader is reading while it is above 0)."""
        return self._active


class ReaderPool:
    def __init__(self, threads: int, busy: BusyClock | None = None):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._stop = threading.Event()
        self._seq = itertools.count()
        self.current: dict[int, tuple[str, float]] = {}  # thread id -> (what it is reading, since when)
        self.unjoined: list[str] = []  # after close(): threads still stuck in a read, and what they read
        # Workers hold the queue, the stop event and `current`, never the pool: a pool dropped without close()
        # is collected, and its finalizer stops the threads.
        self.busy = busy or BusyClock()
        self._threads = [threading.Thread(target=_work, args=(self._queue, self._stop, self.current, self.busy),
                                          name=f"offload-reader-{i}", daemon=True) for i in range(threads)]
        self._finalizer = weakref.finalize(self, _wake, self._queue, self._stop, threads)
        try:
            for t in self._threads:
                t.start()
        except BaseException:  # e.g. Ctrl-C while a thread starts: the pool is never returned, so stop it here
            self.close()
            raise

    @property
    def threads(self) -> int:
        return len(self._threads)

    def submit(self, priority: int, fn: Callable[[], object], what: str) -> Future:
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError(f"reader pool is closed; cannot read {what}"))
            return fut
        self._queue.put((priority, next(self._seq), fut, fn, what))
        return fut

    def threads_alive(self) -> list[str]:
        """The names of the worker threads still running (all of them while open; none once closed)."""
        return [t.name for t in self._threads if t.is_alive()]

    def reads_in_progress(self) -> list[ReadInProgress]:
        """What every busy worker is reading, oldest first."""
        reads = [self._job(tid) for tid in list(self.current)]
        return sorted((r for r in reads if r is not None), key=lambda r: -r.seconds)

    def _job(self, tid: int | None) -> ReadInProgress | None:
        job = self.current.get(tid)
        if job is None:
            return None
        rng = _RANGES.get(tid)
        path, offset, nbytes = rng if rng is not None else (None, None, None)
        return ReadInProgress(job[0], path, offset, nbytes, time.monotonic() - job[1])

    def in_progress(self) -> list[str]:
        return [str(r) for r in self.reads_in_progress()]

    def last_progress(self) -> float:
        """When a worker last finished a system call or a job (time.monotonic(); 0.0 if never)."""
        return max((_PROGRESS.get(t.ident, 0.0) for t in self._threads if t.ident is not None), default=0.0)

    def wait_any(self, futures: Collection[Future], timeout: float, waited_for: Collection[str] = ()
                 ) -> set[Future]:
        """The futures that are done, as soon as one is. The watchdog: an IOStallError (located at the read it is
        stuck in) once no worker has made progress for `timeout` seconds since the wait began."""
        start = time.monotonic()
        tick = max(0.01, min(0.25, timeout / 4))
        warned = False
        while True:
            done, _ = wait(futures, timeout=tick, return_when=FIRST_COMPLETED)
            if done:
                return done
            idle = time.monotonic() - max(start, self.last_progress())
            if idle >= timeout:
                raise self.stall_error(timeout, waited_for)
            if not warned and STALL_WARN_S <= idle:
                warned = True
                log.warning("reads slow: no progress for %.1fs (failing after %gs); in progress: %s", idle, timeout,
                            "; ".join(self.in_progress()) or "nothing")

    def stall_error(self, timeout: float, waited_for: Collection[str] = ()) -> IOStallError:
        """The error for a consumer that waited `timeout` seconds without any read completing: an IOStallError
        (an IOFault and a TimeoutError) located at the oldest read in progress of the units it waited for (of
        any unit if none of those is being read), listing every read in progress."""
        reads = self.reads_in_progress()
        located = next((r for r in reads if r.path is not None and r.what in waited_for), None)
        located = located or next((r for r in reads if r.path is not None), None)
        listing = "; ".join(str(r) for r in reads) or "nothing"
        reason = f"read stalled: no read completed for {timeout:g}s; in progress: {listing}"
        if located is None:
            return IOStallError("<no read in progress>", -1, errno.ETIMEDOUT, reason)
        return IOStallError(located.path, located.offset, errno.ETIMEDOUT, reason)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> list[str]:
        """Stop the workers and join them, waiting `timeout` seconds at most in all. Returns (and keeps in
        `unjoined`) what the threads that did not finish were reading; they are daemons and exit when it returns."""
        self._stop.set()
        while True:  # cancel what never started
            try:
                _, _, fut, _, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                fut.cancel()
        # wakes idle workers at once; called directly (not through the spent finalizer) so that a rerun after
        # an interrupt still wakes them
        self._finalizer.detach()
        _wake(self._queue, self._stop, len(self._threads))
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(max(0.0, deadline - time.monotonic()))
        self.unjoined = [f"{t.name}: {self._job(t.ident) or 'idle'}" for t in self._threads
                         if t.ident is not None and t.is_alive()]
        if self.unjoined:
            log.warning("reader threads still blocked after %.1fs, left running as daemons: %s", timeout,
                        "; ".join(self.unjoined))
        return self.unjoined


def _wake(q: queue.PriorityQueue, stop: threading.Event, n: int) -> None:
    """Stop the workers: idle ones wake on a sentinel job at once (the pool was closed, or dropped unclosed)."""
    stop.set()
    for k in range(n):
        q.put((-1, -1 - k, None, None, ""))


def _one_openmp_thread() -> None:
    """This thread's OpenMP regions on one thread: libgomp's omp_set_num_threads, whose setting is the calling
    thread's own, after torch has set this thread up (its first parallel call sets the thread to torch's default).
    Not torch.set_num_threads: it also changes that process-wide default, which threads set up later (the
    compute team's) then take (measured: a resident bf16 token 12 -> 18 ms). Where no libgomp is loaded (another
    OpenMP runtime, or none), nothing to do."""
    torch.get_num_threads()  # torch's per-thread set-up, now rather than at this thread's first copy
    try:
        libgomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:  # not loaded: torch runs another OpenMP, or none
        return
    libgomp.omp_set_num_threads(1)


def _work(q: queue.PriorityQueue, stop: threading.Event, current: dict, busy: BusyClock) -> None:
    # A reader's torch copies (bounce buffer -> slot) run on its own thread. At torch's thread count each reader
    # keeps a team of OpenMP workers; libgomp counts them against the cores and then throttles the compute team's
    # spin-wait, whose workers sleep between a decode step's ~100 parallel regions: on 2 cores, ~140 context
    # switches and 12.5 -> 16-20 ms a resident bf16 token with direct I/O (docs/PERF.md, session 24).
    _one_openmp_thread()
    me = threading.get_ident()
    _PROGRESS[me] = time.monotonic()
    try:
        _serve(q, stop, current, busy, me)
    finally:
        _PROGRESS.pop(me, None)


def _serve(q: queue.PriorityQueue, stop: threading.Event, current: dict, busy: BusyClock, me: int) -> None:
    while not stop.is_set():
        try:
            _, _, fut, fn, what = q.get(timeout=0.5)
        except queue.Empty:
            continue
        if fut is None:  # sentinel from _wake
            continue
        if not fut.set_running_or_notify_cancel():
            continue
        current[me] = (what, time.monotonic())
        busy.enter()
        try:
            fut.set_result(fn())
        except BaseException as e:  # delivered to the consumer, never swallowed
            fut.set_exception(e)
        finally:
            busy.exit()
            current.pop(me, None)
            _RANGES.pop(me, None)
            _PROGRESS[me] = time.monotonic()
        del fut, fn  # a finished job's closure (and the slot buffer it holds) is not kept alive by an idle worker
