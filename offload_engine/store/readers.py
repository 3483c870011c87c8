"""A pool of reader threads with a priority queue: demand reads (priority 0) jump ahead of prefetches.

Workers never die silently: a read's exception is set on its future and re-raised in the consumer. Every
wait is bounded, shutdown joins every thread, and a stuck read is reported with its file and offset.
"""
from __future__ import annotations

import itertools
import mmap
import queue
import threading
from concurrent.futures import Future
from typing import Callable

DEMAND, PREFETCH = 0, 1


class ReaderPool:
    def __init__(self, threads: int, bounce_bytes: int = 0):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._stop = threading.Event()
        self._seq = itertools.count()
        self._local = threading.local()
        self._bounce_bytes = bounce_bytes
        self.current: dict[int, str] = {}  # thread id -> what it is reading (for stall reports)
        self._threads = [threading.Thread(target=self._work, name=f"offload-reader-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn: Callable[[], object], what: str) -> Future:
        fut: Future = Future()
        self._queue.put((priority, next(self._seq), fut, fn, what))
        return fut

    def bounce(self) -> memoryview:
        """This worker's page-aligned bounce buffer for O_DIRECT (anonymous mmap: aligned by construction)."""
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            buf = self._local.bounce = memoryview(mmap.mmap(-1, self._bounce_bytes))
        return buf

    def _work(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            try:
                _, _, fut, fn, what = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            self.current[me] = what
            try:
                fut.set_result(fn())
            except BaseException as e:  # delivered to the consumer, never swallowed
                fut.set_exception(e)
            finally:
                self.current.pop(me, None)

    def in_progress(self) -> list[str]:
        return list(self.current.values())

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        while True:  # cancel what never started
            try:
                _, _, fut, _, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            fut.cancel()
        for t in self._threads:
            t.join(timeout)
