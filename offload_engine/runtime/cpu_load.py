"""Whether other work holds this process's cores: the share of its runnable time that the calling thread spent
waiting for a core (the scheduler's run-queue delay, /proc/thread-self/schedstat), between two samples. The
thread rule (runtime/threads.py) starts from it and asks it before trying more threads.

Not the machine's load or /proc/stat's busy time: work at a lower weight (a nice value, another session's
autogroup, a smaller cgroup share) looks just as busy there, yet yields its core to the engine's threads at once.
Measured on the 2-core machine (a thread spinning for 1 s): 0.01 with the other sessions' work (load ~15) under
an autogroup at nice -20, 0.46 beside two busy processes of its own session, 0.60 at the same weight as load ~15.
"""
from __future__ import annotations

import os
import threading
import time


class CpuSample:
    """waited(): the share of the calling thread's runnable time since the last sample (construction or
    waited()) that it spent waiting for a core; None where schedstat cannot be read (not Linux, a kernel without
    it), on another thread than the last sample's, or under `min_s` after it."""

    def __init__(self):
        self._last = _read()
        self.readable = self._last is not None

    def waited(self, min_s: float = 0.005) -> float | None:
        now, last = _read(), self._last
        if now is None or last is None or now[0] != last[0]:
            self._last = now
            return None
        if now[1] - last[1] < min_s:
            return None
        self._last = now
        ran, waited = now[2] - last[2], now[3] - last[3]
        return waited / (ran + waited) if ran + waited > 0 else 0.0


def sample_other_load(seconds: float = 0.02) -> CpuSample:
    """A CpuSample over `seconds` of this thread's own busy work, taken once the engine is open: auto's first
    thread count. Sampled over the whole open instead, the engine's own reader threads (a 17 GB checkpoint read
    at open) made the opening thread wait for a core on an idle machine, and auto started at one thread."""
    sample = CpuSample()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return sample


def _read() -> tuple[int, float, int, int] | None:
    """(thread id, monotonic seconds, ns on a core, ns waiting on a run queue) of the calling thread."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return threading.get_ident(), time.monotonic(), int(ran), int(waited)
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, which taskset or a cgroup's cpuset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
