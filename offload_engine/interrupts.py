"""Cleanup that a Ctrl-C cannot cut short.

A KeyboardInterrupt is raised in the main thread at the next function call or loop iteration, wherever that is:
inside a close() that is joining reader threads, it would leave threads and descriptors behind. Cleanup paths
run their (idempotent) close through `finish_despite_interrupts`, which reruns it until it completes and then
re-raises the interrupt, so the request still ends with KeyboardInterrupt (exit status 130 in the CLI).
"""
from __future__ import annotations

from typing import Callable

MAX_RERUNS = 8  # a user pressing Ctrl-C repeatedly still gets out


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
