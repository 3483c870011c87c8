"""A pipeline rank killed (SIGKILL) or stopped (SIGSTOP) mid-request: the request fails on rank 0 within the rank
timeout with an error naming that rank, no rank hangs, and the pipeline opens again (tools/rank_death.py; it
runs 20 trials by hand, CI a few). And the CLI: `run --devices cpu,cpu` prints what the single process prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

TIMEOUT_S = 2.0


def test_a_killed_or_stopped_rank_fails_the_request_naming_it(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "rank_death.py"), "--model", str(path), "--world",
                           "3", "--trials", "3", "--stall", "1", "--timeout", str(TIMEOUT_S), "--json"],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["mode"], r["victim"]) for r in results] == [("stop", 1), ("kill", 2), ("kill", 1)]
    for r in results:
        assert r["failed"] and r["rank"] == r["victim"], r
        assert f"pipeline rank {r['victim']} failed" in r["error"]
        assert r["seconds"] <= TIMEOUT_S + 2.0, r
        assert r["ok"], r
    assert done.returncode == 0, done.stderr[-2000:]


def test_run_with_devices_prints_the_single_process_result(checkpoint_factory):
    path = str(checkpoint_factory("qwen3_moe"))
    command = [sys.executable, "-m", "offload_engine.cli", "run", "--model", path, "--prompt", "def f(x):",
               "--max-new-tokens", "4", "--json", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    one = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    two = subprocess.run(command + ["--devices", "cpu,cpu", "--split", "0:1,1:3", "--ram", "4MiB,3MiB"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    single, split = json.loads(one.stdout), json.loads(two.stdout)  # one JSON object: rank 0's
    assert split["token_ids"] == single["token_ids"] and split["text"] == single["text"]
    assert split["stats"]["world_size"] == 2
    ranks = split["stats"]["ranks"]
    assert [r["layers"] for r in ranks] == [[1, 2], [0, 0]]  # rank 1 runs stage 0
    assert ranks[0]["budget_bytes"]["host"] != ranks[1]["budget_bytes"]["host"]  # --ram: one per rank
    assert all(r["peak_bytes"]["host"] <= r["budget_bytes"]["host"] for r in ranks)
    bad = subprocess.run(command + ["--devices", "cpu,gpu"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "--devices" in bad.stderr


def test_torchrun_runs_the_ranks_as_the_single_process_command_does(checkpoint_factory):
    """`torchrun --standalone --nproc-per-node 2 $(which offload-engine) run ... --json` (the issue's command):
    rank 0 prints the one result, the single process's tokens, with world_size 2 in its stats."""
    torchrun, script = (Path(sys.executable).with_name(n) for n in ("torchrun", "offload-engine"))
    if not (torchrun.is_file() and script.is_file()):
        pytest.skip("torchrun or the offload-engine script is not beside this Python")
    path = str(checkpoint_factory("qwen3_moe"))
    args = ["run", "--model", path, "--prompt", "def f(x):", "--max-new-tokens", "4", "--json", "--quiet",
            "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    one = subprocess.run([sys.executable, "-m", "offload_engine.cli", *args], capture_output=True, text=True,
                         timeout=120, env=env)
    two = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), *args],
                         capture_output=True, text=True, timeout=180, env=env)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    lines = [line for line in two.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    single, ranked = json.loads(one.stdout), json.loads(lines[0])
    assert ranked["token_ids"] == single["token_ids"] and ranked["stats"]["world_size"] == 2


class FailingReader:
    """A rank's checkpoint reads fail (EIO) once `flag` exists: a disk going bad under one rank mid-request."""

    def __init__(self, flag: str):
        self.flag = flag

    def __call__(self, files, r, blob):
        from offload_engine.store.disk import read_range

        if os.path.exists(self.flag):
            raise OSError(5, f"injected read error at {r.file}:{r.file_offset}")
        read_range(files, r, blob)


def _rank_with_a_bad_disk(rank: int, world: int, port: int, path: str, flag: str, out: str) -> None:
    import torch

    from offload_engine import Budget
    from offload_engine.config import EngineConfig
    from offload_engine.distributed.engine import open_rank, serve_rank
    from offload_engine.distributed.group import RankFailedError, Topology, leave_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    options = dict(budget=Budget(ram="25%"), direct_io="off", prefetch=False)
    if rank == 1:
        options["read_fn"] = FailingReader(flag)
    handle = open_rank(path, EngineConfig.from_keywords(device="cpu", **options),
                       Topology(rank, world, torch.device("cpu"), "gloo"), timeout=30)
    if rank != 0:
        try:
            serve_rank(handle)
        except RankFailedError:
            pass  # expected: the request failed; this rank ended serving once rank 0 left
        return
    try:
        for i, _ in enumerate(handle.stream(list(range(1, 9)), max_new_tokens=200, ignore_eos=True)):
            if i == 1:
                open(flag, "w").close()
        message = "no failure"
    except RankFailedError as e:
        message = f"{e.rank}|{e}"
    finally:
        handle.close()
        leave_group()
    with open(out, "w") as f:
        f.write(message)


def test_a_rank_whose_reads_fail_mid_request_is_named(checkpoint_factory, tmp_path):
    import torch.multiprocessing as mp

    from tests.distributed_ranks import free_port

    path, out = str(checkpoint_factory("qwen3_moe", "offload")), str(tmp_path / "out.txt")
    mp.start_processes(_rank_with_a_bad_disk, args=(3, free_port(), path, str(tmp_path / "flag"), out), nprocs=3,
                       start_method="spawn")
    rank, message = open(out).read().split("|", 1)
    assert rank == "1" and "pipeline rank 1 failed" in message and "injected read error" in message, message
