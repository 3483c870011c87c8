#!/usr/bin/env python3
"""Where a resident decode step's time goes on the CPU: each native kernel's wall time per token (the calls are
wrapped and timed), the rest being the engine's Python and torch's small ops; and the prefill rate. Prints a table
and writes JSON. Decode is the difference of two requests (8 and 8 + --tokens new tokens), so that the prompt's
prefill and the request's set-up do not count (session 22's figures in docs/PERF.md included them).

    python tools/decode_profile.py --model bench-out/formats/qwen3_moe-bench-ct-int8 --tokens 64 --json out.json

Run it on a quiet machine (`chrt -f 10`): the wrapper adds ~1 us per call, nothing else.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_engine import Engine  # noqa: E402

SHORT = 8  # new tokens of the request whose time is subtracted (prefill and set-up)


class TimedModule:
    """The native kernels' module (or the native decode plan) with every call timed into `seconds` / `calls` (by
    function name, after `prefix`)."""

    def __init__(self, module, prefix: str = "", seconds=None, calls=None) -> None:
        self._module, self._prefix = module, prefix
        if seconds is not None:  # sharing another's tallies
            self.seconds, self.calls = seconds, calls
            return
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)
        if not callable(fn):
            return fn

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self._prefix + name] += time.perf_counter() - start
                self.calls[self._prefix + name] += 1
        return timed


def _timed_run(engine: Engine, prompt: list[int], steps: int, timed: TimedModule | None
               ) -> tuple[float, dict[str, float], collections.Counter]:
    """Wall seconds of generate(prompt, steps) and the native seconds / calls it added."""
    seconds = dict(timed.seconds) if timed is not None else {}
    calls = collections.Counter(timed.calls) if timed is not None else collections.Counter()
    start = time.perf_counter()
    engine.generate(prompt, max_new_tokens=steps, ignore_eos=True)
    wall = time.perf_counter() - start
    if timed is None:
        return wall, {}, collections.Counter()
    return wall, {k: v - seconds.get(k, 0.0) for k, v in timed.seconds.items()}, timed.calls - calls


def profile(model: str, tokens: int, prompt_len: int, layer_loop: bool = False) -> dict:
    """Decode figures are the difference of two requests, SHORT and SHORT + tokens new tokens of one prompt: the
    prompt's prefill and the request's set-up cancel out, what is left is `tokens` decode steps. A resident model
    decodes its layers in one native call (runtime/decode_plan.py: `DecodePlan.run`); layer_loop: without it, the
    layer loop's calls one by one."""
    prompt = [5 + (7 * i) % 1000 for i in range(prompt_len)]
    with Engine.open(model, max_context=prompt_len + SHORT + tokens + 8) as engine:
        engine.generate(prompt[:16], max_new_tokens=tokens, ignore_eos=True)  # warm: kernel forms, choices
        kernels, plan = engine.model.kernels, engine.model.decode_plan
        timed = None
        if layer_loop:
            engine.model.layer_loop_only()
            plan = None
        if kernels is not None:
            timed = kernels.module = TimedModule(kernels.module)
        if plan is not None:
            plan.native = TimedModule(plan.native, "DecodePlan.", timed.seconds, timed.calls)
        short_s, short_native, short_calls = _timed_run(engine, prompt[:16], SHORT, timed)
        long_s, long_native, long_calls = _timed_run(engine, prompt[:16], SHORT + tokens, timed)
        per_token = (long_s - short_s) / tokens
        ops = {name: {"ms_per_token": (s - short_native.get(name, 0.0)) / tokens * 1e3,
                      "calls_per_token": (long_calls[name] - short_calls[name]) / tokens}
               for name, s in sorted(long_native.items(), key=lambda kv: -kv[1])}
        if timed is not None:
            kernels.module = timed._module
        if plan is not None:
            plan.native = plan.native._module
        start = time.perf_counter()
        engine.logits(prompt)
        prefill = time.perf_counter() - start
        return {"model": model, "dtype": str(engine.dtype).replace("torch.", ""),
                "isa": None if kernels is None else kernels.describe()["isa"], "tokens": tokens,
                "decode_plan": plan is not None, "decode_tok_s": 1 / per_token, "ms_per_token": per_token * 1e3, "native_ops": ops,
                "native_ms_per_token": sum(o["ms_per_token"] for o in ops.values()),
                "prefill_tokens": prompt_len, "prefill_tok_s": prompt_len / prefill}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens of the timed prefill")
    ap.add_argument("--layer-loop", action="store_true",
                    help="decode through the layer loop even where one native call takes all layers (the split "
                         "per block: attention_block, moe_row, ...)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    r = profile(args.model, args.tokens, args.prompt_len, args.layer_loop)
    print(f"{r['model']}: {r['dtype']}, kernels {r['isa'] or 'torch'}: {r['decode_tok_s']:.1f} tok/s decode "
          f"({r['ms_per_token']:.2f} ms/token), prefill {r['prefill_tok_s']:.0f} tok/s over {r['prefill_tokens']}")
    print(f"{'native op':18s} {'ms/token':>9s} {'calls/token':>12s}")
    for name, op in r["native_ops"].items():
        print(f"{name:18s} {op['ms_per_token']:9.2f} {op['calls_per_token']:12.1f}")
    rest = r["ms_per_token"] - r["native_ms_per_token"]
    print(f"{'native, in all':18s} {r['native_ms_per_token']:9.2f}\n{'the rest (Python)':18s} {rest:9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
