"""The compute threads of an engine: one rule for the API and the CLI (EngineConfig.threads, `--threads`), applied
by Engine.open and kept right while the engine decodes (ThreadTuner).

torch runs a decode step as ~100 small parallel regions on an OpenMP team whose threads meet at a barrier after
each. Where other busy processes share the cores, the scheduler sets a team member aside for a time slice and
every barrier waits for it: on 2 cores at load ~6 the demo model decoded at 4.1 tok/s on 2 threads and 334 on 1,
and with one busy process per core the bench checkpoint fell to 0.25 of its idle speed (issue 45; docs/PERF.md
"Shared CPU"). One thread has no barrier to wait at. So `auto`:

- at most `ceiling`: the count torch had before any engine set one (torch.set_num_threads or OMP_NUM_THREADS, else
  torch's default: the cores), within the cores this process may run on, one fewer while weights stream (the
  reader threads need a core);
- at open, all of them where the thread that opened the engine hardly waited for a core meanwhile (its
  run-queue delay, runtime/cpu_load.py), fewer the longer it waited;
- while decoding, ThreadTuner measures: now and then one window of decode steps at a neighbouring count, kept
  where it is faster per token. Probing costs at most PROBE_SHARE of the decode time: a probe step far slower
  than the current count's ends the probe, and the next one waits in proportion to what it lost (and twice as
  long after each probe that lost). A probe up is put off while the decoding thread waits for a core (other
  work at the same weight holds them), until the wait reaches MAX_WAIT_S. A window much faster or slower than
  the one before it (other work started or ended) brings the next probe forward.

libgomp's wait policy stays as it is (threads spin a while at a barrier; OMP_WAIT_POLICY / GOMP_SPINCOUNT are
read once, when torch loads it): on the bench checkpoint (docs/PERF.md "Shared CPU") PASSIVE and a short spin
count cost 30-70% of the idle speed on 2 threads and still lost to one thread under load.

A fixed count (threads=N) is set as given and never changed. Neither touches the reader threads' own OpenMP
setting (store/readers.py _one_openmp_thread). torch's count is process-wide and also each thread's own OpenMP
setting: a request makes the thread it runs on use the engine's count (ThreadTuner.enter).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import AUTO, check_threads  # noqa: F401 (the option's check, with it)
from .cpu_load import CpuSample, usable_cores
PROBE_SHARE = 0.03  # most of the decode time that probing other thread counts may cost
WARMUP_STEPS = 2  # an engine's first decode steps, left out of every window: the first builds the one-call decode
#   plan (1.7 s on a 48-layer model, against ~0.1 s a step), which made two threads look slower than one
WINDOW_TOKENS = 8  # decode tokens per measured window...
WINDOW_S = 0.02  # ...and at least this long
MARGIN = 0.10  # a probed count is kept when its window is this much faster per token
ABORT = 3.0  # a probe this many times slower than the current count (over >= 4 tokens' time) ends at once
FIRST_PROBE_S = 0.05  # decode seconds before a probe after a switch or a change in speed, then twice as long
IDLE_FIRST_PROBE_S = 0.5  # ...before the first probe down (fewer threads pay on small models only)
BUSY_FIRST_PROBE_S = 1.0  # ...before the first probe up, where the cores were busy at open (it may cost a slow step)
MAX_WAIT_S = 10.0  # ...up to this, unless what a probe lost asks for longer (PROBE_SHARE)
CHANGED = 1.5  # a window this much faster or slower than the one before brings the next probe forward
GATE_S = 0.25  # the least time that look at the run-queue delay before a probe up spans
FREE = 0.1  # a thread that waited for a core this share of its runnable time or less had the cores to itself


_applied: int | None = None  # the count an engine last set
_before: int | None = None  # torch's count before any engine set one


def torch_count() -> int:
    """torch's intra-op count as the user left it: what it is now, unless an engine set that (then what it was
    before the first engine did)."""
    global _before
    now = torch.get_num_threads()
    if _before is None or now != _applied:
        _before = now
    return _before


def set_count(n: int) -> None:
    """torch's intra-op threads, for this thread and as the process default, where they differ."""
    global _applied
    torch_count()  # remember the user's count before the first change
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _applied = n


def auto_ceiling(streams: bool) -> int:
    """The most threads `auto` uses: torch's count within the usable cores, one fewer while weights stream."""
    return max(1, min(torch_count(), usable_cores() - (1 if streams else 0)))


def start_count(ceiling: int, waited: float | None) -> int:
    """The count to start from: all of `ceiling` where the opening thread waited for a core FREE of its
    runnable time or less (or unknown), one where it waited half of it or more, in proportion between."""
    if waited is None or waited <= FREE:
        return ceiling
    return max(1, min(ceiling, round(ceiling * (1 - 2 * waited))))


@dataclass
class _Probe:
    count: int
    seconds: float = 0.0
    tokens: int = 0
    first_s: float | None = None  # the first step at the new count, left out of the comparison (cold threads)


@dataclass
class ThreadTuner:
    """An engine's thread count. setting: 'auto' or the fixed count; `current`: what its steps run at now.
    observe() takes each decode step's seconds and tokens; snapshot() says what ran."""

    setting: int | str
    ceiling: int
    current: int
    cpu: CpuSample | None = None
    switches: int = 0
    probes: int = 0
    tokens_by_count: dict[int, int] = field(default_factory=dict)
    _window: list[float] = field(default_factory=lambda: [0.0, 0])  # seconds, tokens at `current`
    _per_token: float | None = None  # the last full window's seconds per token at `current`
    _probe: _Probe | None = None
    _decode_s: float = 0.0  # decode seconds since the last probe ended (or was put off)
    _wait_s: float = FIRST_PROBE_S  # ...before the next one
    _least_wait_s: float = 0.0  # what the last lost probe cost / PROBE_SHARE
    _up_next: bool = False
    _warmup: int = WARMUP_STEPS  # steps still to leave out

    @classmethod
    def open(cls, setting: int | str, streams: bool, cpu: CpuSample | None = None) -> "ThreadTuner":
        """The count Engine.open applies: a fixed one as given; auto within auto_ceiling, started from how long
        this thread waited for a core since `cpu` was taken (when the open began)."""
        setting = check_threads(setting)
        if setting != AUTO:
            tuner = cls(setting, setting, setting)
        else:
            ceiling = auto_ceiling(streams)
            cpu = cpu if ceiling > 1 else None
            tuner = cls(setting, ceiling, start_count(ceiling, cpu.waited() if cpu else None), cpu)
            tuner._up_next = tuner.current < ceiling
            tuner._wait_s = BUSY_FIRST_PROBE_S if tuner._up_next else IDLE_FIRST_PROBE_S
        set_count(tuner.current)
        return tuner

    @property
    def adaptive(self) -> bool:
        return self.setting == AUTO and self.ceiling > 1

    @property
    def running(self) -> int:
        """The count the steps run at now: a probe's while one runs, else `current`."""
        return self._probe.count if self._probe else self.current

    @property
    def probe_wait_s(self) -> float:
        """Decode seconds from the last probe to the next one (before a look at the run-queue delay)."""
        return self._wait_s

    def enter(self) -> None:
        """At a request's start, on the thread that runs it: its steps use this engine's count."""
        set_count(self.running)

    def observe(self, seconds: float, tokens: int) -> None:
        """A decode step (or one token of a drafted step) took `seconds` for `tokens` tokens at the count now."""
        count = self.running
        self.tokens_by_count[count] = self.tokens_by_count.get(count, 0) + tokens
        if not self.adaptive:
            return
        if self._warmup > 0:  # one-time costs, not the count's speed
            self._warmup -= 1
            return
        self._decode_s += seconds
        if self._probe is not None:
            self._observe_probe(self._probe, seconds, tokens)
            return
        self._window[0] += seconds
        self._window[1] += tokens
        if self._window[1] >= WINDOW_TOKENS and self._window[0] >= WINDOW_S:
            last, self._per_token = self._per_token, self._window[0] / self._window[1]
            self._window = [0.0, 0]
            if last is not None and not 1 / CHANGED < self._per_token / last < CHANGED:
                self._wait_s = max(FIRST_PROBE_S, self._least_wait_s)  # the load changed: look again soon
            if self._decode_s >= self._wait_s:
                self._start_probe()

    def _observe_probe(self, probe: _Probe, seconds: float, tokens: int) -> None:
        ref = self._per_token or 0.0
        if probe.first_s is None:
            probe.first_s = seconds
            if seconds <= ABORT * ref * 4:
                return
        else:
            probe.seconds += seconds
            probe.tokens += tokens
        # far slower than the current count (a step may carry several drafted tokens: >= 4 tokens' time)
        if probe.seconds + probe.first_s > ABORT * ref * max(probe.tokens + 1, 4) or (
                probe.tokens >= WINDOW_TOKENS and probe.seconds >= WINDOW_S):
            self._end_probe(probe, ref)

    def _start_probe(self) -> None:
        up = self.current < self.ceiling and (self._up_next or self.current == 1)
        if up and self.cpu is not None and self.cpu.readable and self._wait_s < MAX_WAIT_S:
            waited = self.cpu.waited(min_s=GATE_S)
            if waited is None:  # too short a look (a core given for a moment): at a later window
                return
            if waited > FREE:  # other work holds the cores: put it off
                self._decode_s, self._wait_s = 0.0, min(MAX_WAIT_S, 2 * self._wait_s)
                return
        self._up_next = not up
        self.probes += 1
        self._probe = _Probe(self.current + (1 if up else -1))
        set_count(self._probe.count)

    def _end_probe(self, probe: _Probe, ref: float) -> None:
        self._probe = None
        if probe.tokens and probe.seconds / probe.tokens < (1 - MARGIN) * ref:
            self.current, self.switches = probe.count, self.switches + 1
            self._per_token, self._wait_s = probe.seconds / probe.tokens, FIRST_PROBE_S  # soon check the way back
            self._up_next = probe.count < self.ceiling
        else:
            lost = probe.seconds + (probe.first_s or 0.0) - (probe.tokens + 1) * ref
            self._least_wait_s = max(0.0, lost) / PROBE_SHARE
            self._wait_s = max(min(MAX_WAIT_S, 2 * self._wait_s), self._least_wait_s)
            set_count(self.current)
        self._decode_s = 0.0
        if self.cpu is not None:
            self.cpu.waited()  # the next look covers the time from here, at the count kept

    def snapshot(self) -> dict[str, Any]:
        """What ran: `threads`, the count now; `tokens_by_threads`, decode tokens per count since open."""
        return {"threads": self.current, "setting": self.setting, "max": self.ceiling, "switches": self.switches,
                "probes": self.probes, "tokens_by_threads": {str(k): v for k, v in sorted(self.tokens_by_count.items())}}
