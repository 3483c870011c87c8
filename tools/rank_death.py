#!/usr/bin/env python3
"""Kill (SIGKILL) or stop (SIGSTOP) one pipeline rank mid-request and time how long the request takes to fail.

    python tools/rank_death.py --model DIR [--world 3] [--trials 20] [--stall 1] [--timeout 3] [--json]

This process is rank 0 (it drives the request and reopens the pipeline after each trial); the other ranks are
fresh processes for each trial (gloo, on this box). A trial passes when the request ends with a RankFailedError
naming the victim within the rank timeout (a dead peer is found at once, a stopped one after the timeout) plus a
margin, and the pipeline then opens again. The victim cycles over the ranks 1 .. world-1; `--stall N` makes the
first N trials stop their victim instead of killing it. CI runs a few trials (tests/test_distributed_failure.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_engine.config import EngineConfig  # noqa: E402
from offload_engine.distributed.engine import open_rank, serve_rank  # noqa: E402
from offload_engine.distributed.group import RankFailedError, Topology, leave_group  # noqa: E402

MARGIN_S = 2.0  # beyond the rank timeout: a failure must arrive within timeout + this
PROMPT = list(range(1, 9))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, path: str, timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    worker = open_rank(path, EngineConfig(device="cpu", prefetch=False),
                       Topology(rank, world, torch.device("cpu"), "gloo"), timeout=timeout)
    try:
        serve_rank(worker)
    except RankFailedError:
        os._exit(1)
  # a peer failed: this rank is done (its error reached rank 0 through the ring)


def trial(path: str, world: int, victim: int, stall: bool, timeout: float) -> dict:
    port = _free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = mp.get_context("spawn")
    procs = {r: ctx.Process(target=_serve, args=(r, world, port, path, timeout), daemon=True)
             for r in range(1, world)}
    for p in procs.values():
        p.start()
    result = {"victim": victim, "mode": "stop" if stall else "kill"}
    engine = open_rank(path, EngineConfig(device="cpu", prefetch=False),
                       Topology(0, world, torch.device("cpu"), "gloo"), timeout=timeout)
    start = None
    try:
        for i, _ in enumerate(engine.stream(PROMPT, max_new_tokens=400, ignore_eos=True)):
            if i == 2:  # mid-request: the prompt is in every rank's cache, decoding has begun
                os.kill(procs[victim].pid, signal.SIGSTOP if stall else signal.SIGKILL)
                start = time.monotonic()
        result.update(failed=False, error="the request finished: no failure seen")
    except RankFailedError as e:
        result.update(failed=True, rank=e.rank, seconds=round(time.monotonic() - start, 3), error=str(e)[:300])
    finally:
        engine.close()
        leave_group()
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(10)
    result["ok"] = (result.get("rank") == victim and result.get("seconds", math.inf) <= timeout + MARGIN_S
                    and all(not p.is_alive() for p in procs.values()))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--stall", type=int, default=1, help="trials whose victim is stopped instead of killed")
    ap.add_argument("--timeout", type=float, default=3.0, help="the rank timeout, seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for t in range(args.trials):
        victim = 1 + t % (args.world - 1)
        results.append(trial(args.model, args.world, victim, t < args.stall, args.timeout))
        if not args.json:
            r = results[-1]
            print(f"trial {t + 1:>2}: {r['mode']} rank {victim}: "
                  f"{'ok' if r['ok'] else 'FAILED'} in {r.get('seconds', '-')} s: {r['error'][:120]}", flush=True)
    if args.json:
        print(json.dumps(results))
    else:
        print(f"{sum(r['ok'] for r in results)}/{len(results)} trials failed the request in time, naming the rank")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
