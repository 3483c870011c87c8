"""The compute thread rule (runtime/threads.py): one rule for the API and the CLI, the count that ran in the
stats, a fixed count honoured, bad values refused by name, and the tuner's choices on given step times (speed
itself is measured by tools/bench_contention.py, not here)."""
from __future__ import annotations

import json

import pytest
import torch

from offload_engine.api import Engine
from offload_engine.cli import main
from offload_engine.config import EngineConfig
from offload_engine.defaults import PACKAGE_MODEL
from offload_engine.errors import ConfigError
from offload_engine.runtime import threads as T
from offload_engine.runtime.cpu_load import CpuSample, usable_cores

PROMPT = "def quicksort(xs):"


@pytest.fixture
def torch_threads():
    """Restore torch's count (the suite runs on one: conftest.py) after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, "0", "two", 1.5, True, None, ""])
def test_a_bad_thread_count_is_refused_naming_the_field_and_the_flag(bad):
    with pytest.raises(ConfigError, match=r"threads \(--threads\)"):
        EngineConfig(threads=bad)


def test_the_config_takes_auto_an_int_or_the_flags_digits():
    assert EngineConfig().threads == "auto"
    assert EngineConfig(threads=3).threads == 3
    assert EngineConfig(threads="3").threads == 3  # the CLI passes its flag's text
    assert EngineConfig.from_dict({"threads": 2}).threads == 2


def test_a_fixed_count_is_honoured_and_reported(torch_threads):
    with Engine.open(PACKAGE_MODEL, threads=2) as engine:
        stats = engine.generate(PROMPT, max_new_tokens=6).stats
        assert torch.get_num_threads() == 2
    assert stats["threads"] == 2
    assert stats["thread_choice"]["setting"] == 2 and stats["thread_choice"]["tokens_by_threads"] == {"2": 5}


def test_auto_stays_within_torchs_count_and_the_cores(torch_threads):
    torch.set_num_threads(1)  # as a user's torch.set_num_threads(1) or OMP_NUM_THREADS=1
    with Engine.open(PACKAGE_MODEL) as engine:
        stats = engine.generate(PROMPT, max_new_tokens=6).stats
    assert stats["threads"] == 1 and stats["thread_choice"]["max"] == 1 and stats["thread_choice"]["setting"] == "auto"
    torch.set_num_threads(2)
    with Engine.open(PACKAGE_MODEL) as engine:  # every unit resident: nothing streams
        stats = engine.generate(PROMPT, max_new_tokens=6).stats
    assert stats["thread_choice"]["max"] == min(2, usable_cores())
    assert 1 <= stats["threads"] <= stats["thread_choice"]["max"]
    assert sum(stats["thread_choice"]["tokens_by_threads"].values()) == 5  # the decode steps, prefill excluded


def test_the_cli_and_the_api_apply_the_same_rule(torch_threads, capsys):
    base = ["run", "--model", str(PACKAGE_MODEL), "--prompt", PROMPT, "--max-new-tokens", "6", "--quiet"]
    assert main(base + ["--threads", "2", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["stats"]
    with Engine.open(PACKAGE_MODEL, threads=2) as engine:
        api = engine.generate(PROMPT, max_new_tokens=6).stats
    assert cli["threads"] == api["threads"] == 2
    assert cli["thread_choice"] == api["thread_choice"] == {"setting": 2, "max": 2, "switches": 0, "probes": 0,
                                                            "tokens_by_threads": {"2": 5}}
    assert main(base + ["--threads", "1", "--stats"]) == 0
    assert ", 1 thread]" in capsys.readouterr().err  # --stats names the count that ran
    assert main(base + ["--threads", "x"]) == 2
    assert "--threads" in capsys.readouterr().err


# ---- the tuner, on given step times ----------------------------------------------------------------------------
def feed(tuner: T.ThreadTuner, per_token: dict[int, float], tokens: int) -> None:
    """`tokens` decode steps, each taking per_token[the count set now]."""
    for _ in range(tokens):
        tuner.observe(per_token[tuner.running], 1)


def test_the_tuner_keeps_the_faster_count_and_bounds_what_probes_cost(torch_threads):
    tuner = T.ThreadTuner(T.AUTO, ceiling=2, current=2)
    feed(tuner, {2: 0.010, 1: 0.004}, 19)  # warm-up steps, a window at 2, a probe at 1 (its first step left out)
    assert tuner.current == 1 and tuner.switches == 1 and torch.get_num_threads() == 1
    # a probe back up that takes 0.25 s for a step ends after that step, and the next waits for 33x what it lost
    probes = tuner.probes
    feed(tuner, {1: 0.004, 2: 0.25}, 200)
    assert tuner.current == tuner.running == 1 and tuner.probes == probes + 1
    assert tuner.probe_wait_s >= (0.25 - 2 * 0.004) / T.PROBE_SHARE * 0.99
    # the cores free again: once that wait is over (~3700 steps at 2 ms), a probe finds two threads faster
    feed(tuner, {1: 0.002, 2: 0.001}, 5000)
    assert tuner.current == 2 and tuner.switches == 2
    assert sum(tuner.tokens_by_count.values()) == 5219


def test_the_first_steps_one_time_costs_do_not_choose_the_count(torch_threads):
    """An engine's first decode step builds the decode plan (seconds on a real-size model): left out, it does not
    make the faster count look slower (the real-size Q4_0 run settled on one thread for 26 of 63 tokens)."""
    tuner = T.ThreadTuner(T.AUTO, ceiling=2, current=2)
    tuner.observe(1.7, 1)  # the first step: the plan built
    tuner.observe(0.2, 1)  # the second: caches cold
    feed(tuner, {2: 0.07, 1: 0.12}, 400)
    assert tuner.current == 2 and tuner.switches == 0 and tuner.tokens_by_count[1] < 0.05 * 402  # probes only


def test_a_fixed_count_is_never_tuned(torch_threads):
    tuner = T.ThreadTuner.open(1, streams=False)
    feed(tuner, {1: 0.01}, 100)
    assert (tuner.current, tuner.probes, tuner.tokens_by_count) == (1, 0, {1: 100})


def test_the_start_follows_how_long_the_opening_thread_waited_for_a_core():
    assert T.start_count(4, None) == 4 and T.start_count(4, 0.05) == 4  # unknown, or the cores free
    assert T.start_count(4, 0.25) == 2 and T.start_count(2, 0.33) == 1 and T.start_count(4, 0.6) == 1
    waited = CpuSample().waited(min_s=0.0)
    assert waited is None or 0.0 <= waited <= 1.0
