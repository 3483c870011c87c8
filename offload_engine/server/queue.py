"""One engine runs one sequence at a time: a worker thread takes jobs from a bounded FIFO and streams each job's
events back to its asyncio consumer. A job cancelled (its client went away) is closed between two decode steps,
which frees the engine for the next job."""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..generate.decoder import FinishEvent, TokenEvent

DONE = object()  # the end of a job's events


@dataclass
class Job:
    """A request for the worker: `start()` returns the engine's event iterator (called on the worker thread)."""
    start: Callable[[], Iterator[Any]]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class QueueFull(Exception):
    pass


class EngineWorker:
    def __init__(self, max_queue: int, on_finish: Callable[[dict], None] | None = None,
                 on_token: Callable[[], None] | None = None):
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.busy = False
        self.current: Job | None = None  # the job being served
        self.on_finish, self.on_token = on_finish, on_token
        self.thread = threading.Thread(target=self._run, name="offload-engine-worker", daemon=True)
        self.thread.start()

    @property
    def queue_length(self) -> int:
        return self.jobs.qsize()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the request queue is full ({self.jobs.maxsize} waiting)") from None

    def cancel_all(self) -> None:
        """The job in progress is cancelled at its next step, those waiting are answered DONE (a server shutting
        down: their responses end now instead of after their last token). The worker goes on."""
        current = self.current
        if current is not None:
            current.cancelled.set()
        while True:
            try:
                waiting = self.jobs.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                waiting.cancelled.set()
                waiting.put(DONE)

    def stop(self) -> None:
        """Ends the worker: every job cancelled (cancel_all), then the thread joined."""
        self.cancel_all()  # drains the queue, so the sentinel below always finds room
        self.jobs.put_nowait(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                job.put(DONE)
                continue
            self.busy, self.current = True, job
            try:
                self._serve(job)
            finally:
                self.busy, self.current = False, None

    def _serve(self, job: Job) -> None:
        events = None
        try:
            events = job.start()
            for event in events:
                if isinstance(event, TokenEvent) and self.on_token is not None:
                    self.on_token()  # counted before the check below: the step that ran after a cancel counts
                if job.cancelled.is_set():
                    break  # the client left: close the stream now (between two steps), freeing the engine
                if isinstance(event, FinishEvent) and self.on_finish is not None:
                    self.on_finish(event.stats)
                job.put(event)
        except Exception as e:  # handed to the request's handler, which answers an error object
            job.put(e)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()
            job.put(DONE)
