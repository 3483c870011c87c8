"""What a speculative step costs, op by op, against a plain step: the breakdown issue 29 asks for where `--spec`
does not pay.

Greedy requests on one engine, alternating `--spec off` and the mode profiled (default: MTP at depth 1, width 1
where the checkpoint has MTP layers, else n-gram; with a fixed depth and width every step speculates, so each
is timed). Each of the model's ops (StandardOps' methods, MoEBlock calls, CausalLM.head / embed, the MTP head's forward,
the verifier) is wrapped by a timer that records its exclusive wall time (time inside nested timed ops is
charged to them), grouped by the step's phase: off (a --spec off step), plain (a step the chooser left plain),
draft (the drafter's proposal), verify (the target's forward over the tree and what follows it) and choose (the
rest of a speculative stepper's step: planning, shadow-scoring the n-gram drafter, bookkeeping). The table gives
ms per step of each phase's kind (choose: per step of any kind) and what the measured acceptance makes of them:
tokens per speculative step and the speed-up those costs allow.

    python tools/spec_profile.py --json spec-profile.json                  # the bundled demo model, MTP depth 1
    python tools/spec_profile.py --spec auto --spec-depth 0               # what auto costs where it does not draft
    python tools/spec_profile.py --model M --spec-depth 2 --budget 25%

Timers add ~2 us a call, on both sides alike; the per-op split is for reading, the totals are the step times.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from offload_engine import Budget, Engine  # noqa: E402
from offload_engine.generate.decoder import PlainStepper  # noqa: E402
from offload_engine.runtime.moe_block import MoEBlock  # noqa: E402
from offload_engine.runtime.mtp import MtpHead  # noqa: E402
from offload_engine.speculative import stepper as stepper_module  # noqa: E402
from offload_engine.speculative.stepper import SpeculativeStepper  # noqa: E402

from tools.bench_spec import PROMPTS  # noqa: E402

# the architecture's ops timed (wrapped on the engine's own ops object)
OPS = ("embed", "input_norm", "attention", "post_norm", "route", "expert", "shared_experts", "dense_mlp",
       "decode_block", "logits", "mtp_input", "mtp_output", "final_norm", "head_logits")
# the MoE blocks (runtime/moe_block.py, the trunk's and the MTP layers'): what remains of a call once its nested
# ops are charged (dispatch, combine), and of a one-token step's one native call
MODEL_OPS = (("__call__", "moe"), ("one_row", "moe_row"))


class Timers:
    """Exclusive seconds per (phase, op): a stack of running timers, each charging its callees' time to them."""

    def __init__(self):
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.phase = "other"
        self._stack: list[list[float]] = []  # [start, nested seconds]

    @contextmanager
    def timing(self, label: str):
        self._stack.append([time.perf_counter(), 0.0])
        try:
            yield
        finally:
            start, nested = self._stack.pop()
            total = time.perf_counter() - start
            self.seconds[(self.phase, label)] += total - nested
            if self._stack:
                self._stack[-1][1] += total

    @contextmanager
    def in_phase(self, phase: str):
        before, self.phase = self.phase, phase
        try:
            with self.timing("(step overhead)"):
                yield
        finally:
            self.phase = before

    def wrap(self, owner, name: str, label: str | None = None, phase: str | None = None) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        label = label or name

        def timed(*args, **kwargs):
            if phase is not None:
                with self.in_phase(phase):
                    return original(*args, **kwargs)
            with self.timing(label):
                return original(*args, **kwargs)
        setattr(owner, name, timed)


def instrument(engine: Engine, timers: Timers) -> None:
    for name in OPS:
        timers.wrap(engine.model.ops, name)
    for name, label in MODEL_OPS:
        timers.wrap(MoEBlock, name, label)
    timers.wrap(engine.model, "head", "head (unit)")
    timers.wrap(engine.model, "embed", "embed (unit)")
    # the phases: a plain stepper's step, the speculative stepper's proposal and verification
    timers.wrap(PlainStepper, "step", phase="off")
    timers.wrap(SpeculativeStepper, "step", phase="choose")
    timers.wrap(SpeculativeStepper, "_propose", phase="draft")
    timers.wrap(SpeculativeStepper, "_verify", phase="verify")
    timers.wrap(SpeculativeStepper, "_plain", phase="plain")
    timers.wrap(stepper_module, "verify", "verifier.verify")
    timers.wrap(MtpHead, "forward", "mtp layer (rest)")


def request(engine: Engine, prompt: str, tokens: int, spec: str, depth: int | None, width: int | None) -> dict:
    done = engine.generate(prompt, max_new_tokens=tokens, ignore_eos=True, spec=spec, spec_depth=depth,
                           spec_width=width)
    return {**done.stats, "token_ids": done.token_ids}


def profile(model: Path, budget: str | None, prompt: str, tokens: int, spec: str | None, depth: int | None,
            width: int | None, repeat: int) -> dict:
    timers = Timers()
    ram = Budget(ram=budget) if budget else Budget()
    context = len(prompt) + 2 * tokens + 64
    if spec is None:
        with Engine.open(model, budget=ram, max_context=context, spec="mtp") as probe:
            spec = "mtp" if probe.speculative.mode == "mtp" else "ngram"
    with Engine.open(model, budget=ram, max_context=context, spec=spec) as engine:
        request(engine, "warm-up: " + prompt[::-1], tokens, "off", None, None)
        instrument(engine, timers)
        runs: dict[str, list[dict]] = {"off": [], spec: []}
        for _ in range(repeat):
            runs["off"].append(request(engine, prompt, tokens, "off", None, None))
            runs[spec].append(request(engine, prompt, tokens, spec, depth, width))
        dtype, native = str(engine.model.dtype).replace("torch.", ""), engine.model.kernels is not None
    # every request's first token comes from its prefill (outside the steps); a decode step ends in one forward
    off_steps = sum(len(s["token_ids"]) - 1 for s in runs["off"])
    steps = sum(s["target_forwards"] - 1 for s in runs[spec])
    spec_steps = sum(s["spec_steps"] for s in runs[spec])
    accepted = sum(s["accepted_tokens"] for s in runs[spec])
    per_step = {"off": off_steps, "plain": steps - spec_steps, "draft": spec_steps, "verify": spec_steps,
                "choose": steps}
    table = {op: {ph: 1e3 * timers.seconds.get((ph, op), 0.0) / max(n, 1) for ph, n in per_step.items()}
             for op in sorted({op for _, op in timers.seconds})}
    totals = {ph: sum(row[ph] for row in table.values()) for ph in per_step}
    off_ms = totals["off"]
    tokens_per_step = 1.0 + accepted / spec_steps if spec_steps else 1.0
    spec_ms = totals["draft"] + totals["verify"] + totals["choose"]
    return {"model": str(model), "spec": spec, "depth": depth, "width": width, "tokens": tokens, "repeat": repeat,
            "dtype": dtype, "native": native, "steps": per_step, "ms_per_step": table, "totals_ms": totals,
            "tokens_per_spec_step": tokens_per_step,
            "draft_over_off": totals["draft"] / off_ms if off_ms else 0.0,
            "verify_over_off": totals["verify"] / off_ms if off_ms else 0.0,
            # a speculative step's tokens against as many --spec off steps
            "spec_step_speedup": tokens_per_step * off_ms / spec_ms if spec_steps and spec_ms else 0.0,
            "plain_step_over_off": (totals["plain"] + totals["choose"]) / off_ms if off_ms and steps > spec_steps
            else 0.0,
            "decode_tok_s": {m: [round(s["decode_tok_s"], 2) for s in r] for m, r in runs.items()}}


def print_table(r: dict) -> None:
    shape = "chosen each step" if r["depth"] is None else f"depth {r['depth']} width {r['width']}"
    print(f"{r['model']}: --spec {r['spec']} ({shape}), {r['dtype']}, native kernels "
          f"{'on' if r['native'] else 'off'}; exclusive ms per step of each kind (steps: {r['steps']})")
    phases = [p for p in ("off", "plain", "draft", "verify", "choose") if r["steps"][p]]
    print(f"{'op':<22}" + "".join(f"{p:>9}" for p in phases))
    for op, row in sorted(r["ms_per_step"].items(), key=lambda kv: -sum(kv[1].values())):
        if max(row[p] for p in phases) >= 0.005:
            print(f"{op:<22}" + "".join(f"{row[p]:>9.3f}" for p in phases))
    print(f"{'total':<22}" + "".join(f"{r['totals_ms'][p]:>9.3f}" for p in phases))
    if r["steps"]["draft"]:
        print(f"tokens per speculative step {r['tokens_per_spec_step']:.2f}; drafting {r['draft_over_off']:.2f}x "
              f"and verifying {r['verify_over_off']:.2f}x an off step: a speculative step yields "
              f"{r['spec_step_speedup']:.2f}x the tokens per second of --spec off")
    if r["plain_step_over_off"]:
        print(f"a plain step of --spec {r['spec']} (with its choosing) costs {r['plain_step_over_off']:.2f}x an off step")
    print("decode tok/s per request:", r["decode_tok_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "offload_engine/data/demo-model"))
    ap.add_argument("--budget", default=None, help="--ram budget (default: the engine's default, all resident)")
    ap.add_argument("--prompt", default="code", help=f"one of {sorted(PROMPTS)} or literal text")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--spec", default=None, help="the mode profiled (default: mtp where the checkpoint has MTP "
                                                 "layers, else ngram)")
    ap.add_argument("--spec-depth", type=int, default=1, help="fixed draft depth; 0: chosen each step")
    ap.add_argument("--spec-width", type=int, default=1, help="fixed draft width (with a fixed depth)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    depth, width = (a.spec_depth, a.spec_width) if a.spec_depth else (None, None)
    r = profile(Path(a.model), a.budget, PROMPTS.get(a.prompt, a.prompt), a.tokens, a.spec, depth, width, a.repeat)
    print_table(r)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
