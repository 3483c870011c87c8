#!/usr/bin/env python3
"""Record routing traces and replay them through the expert-cache policies.

  python tools/trace_experts.py record --model DIR [--prompt TEXT | --prompt-file F] --tokens 128 --out trace.json
                                      [--temperature 0.7 --seed 1]
  python tools/trace_experts.py replay trace.json --sizes 5,10,25,50 [--plot policies.png] [--json out.json]
  python tools/trace_experts.py replay trace.json --slots 151,200     # cache sizes in expert slots

A trace lists, for every forward and MoE layer, the experts each token was routed to. Replay simulates a cache
of N expert slots (N = a percentage of all experts) under each policy of offload_engine.store.policy, the same
pure functions the store uses, plus the clairvoyant optimum (Belady: evict the unit used farthest in the future)
as the reference line. Each miss here evicts after the units acquired before it were released; the store
reserves a layer's misses up front, while its hits are held, so where the cache holds about one token's experts
per layer the engine can rank the policies otherwise (policy.resolved; docs/PERF.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from offload_engine.runtime.moe import routed_experts  # noqa: E402
from offload_engine.store.policy import POLICIES, Usage, choose_victim  # noqa: E402


def routing_trace(model, prompts: list, tokens: int, context: int, **sampling) -> dict:
    """The model's routing over consecutive requests (one per prompt: text or token ids; greedy unless
    `sampling` says otherwise), every unit resident: the record format that FrequencyPrior (`run --trace`) and
    the planner (`plan --trace`) read."""
    from offload_engine import Engine

    with Engine.open(model, max_context=context) as engine:
        engine.model.routing_trace = []
        for prompt in prompts:
            engine.generate(prompt, max_new_tokens=tokens, ignore_eos=True, **sampling)
        steps = engine.model.routing_trace
        experts = engine.model.spec.num_experts
    return {"model": str(model), "num_experts": experts, "moe_layers": sorted({l for l, _ in steps}), "steps": steps}


def record(args: argparse.Namespace) -> int:
    prompt = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    sampling = {} if args.temperature is None else {"temperature": args.temperature, "seed": args.seed}
    trace = routing_trace(args.model, [prompt], args.tokens, args.context, **sampling)
    Path(args.out).write_text(json.dumps(trace))
    print(f"wrote {args.out}: {len(trace['steps'])} layer steps")
    return 0


def accesses(trace: dict) -> list[tuple[int, int]]:
    """(layer, expert) in the order the engine acquires them and stamps their recency: per forward and layer,
    runtime.moe.routed_experts' order (by the last token routed to each expert, then the heaviest last). A trace
    lists each token's experts in the router's rank order (heaviest first), so ranks stand in for the weights.
    Replaying in ascending expert ids instead misjudged the policies: on the bench model at 25% it gave layer-lru
    8.3 misses per token and lru 7.7, where the engine, and this order, give 6.8 and 7.6 (docs/PERF.md)."""
    out = []
    for layer, per_token in trace["steps"]:
        indices = torch.tensor(per_token, dtype=torch.long)
        ranks = torch.arange(indices.shape[1], 0, -1, dtype=torch.float32).expand(indices.shape)
        out += [(layer, e) for e in routed_experts(indices, ranks)]
    return out


def next_occurrence(seq: list[tuple[int, int]]) -> list[float]:
    """nxt[t] = the next index after t at which seq[t] is accessed again (inf if never)."""
    nxt: list[float] = [float("inf")] * len(seq)
    last: dict[tuple[int, int], int] = {}
    for t in range(len(seq) - 1, -1, -1):
        nxt[t] = last.get(seq[t], float("inf"))
        last[seq[t]] = t
    return nxt


def simulate(seq: list[tuple[int, int]], slots: int, policy: str, n_layers: int, top_k: int = 1) -> float:
    """Hit rate of a cache of `slots` experts; policy "optimal" is Belady's clairvoyant eviction. top_k: experts
    per token (lru-floor's floor, as the store sets it)."""
    cache: dict[tuple[int, int], Usage] = {}
    next_use: dict[tuple[int, int], float] = {}
    nxt = next_occurrence(seq) if policy == "optimal" else None
    hits = 0
    for t, unit in enumerate(seq):
        if unit in cache:
            hits += 1
            u = cache[unit]
            cache[unit] = Usage(u.slot, unit[0], t, u.score + 1)
        else:
            if len(cache) >= slots:
                if policy == "optimal":
                    victim = max(cache, key=lambda k: next_use[k])
                else:
                    by_slot = {u.slot: k for k, u in cache.items()}
                    victim = by_slot[choose_victim(policy, list(cache.values()), unit[0],
                                                   max(1, slots // n_layers), t, top_k)]
                slot = cache.pop(victim).slot
            else:
                slot = len(cache)
            cache[unit] = Usage(slot, unit[0], t, 1.0)
        if nxt is not None:
            next_use[unit] = nxt[t]
    return hits / len(seq) if seq else 0.0


def replay(args: argparse.Namespace) -> int:
    trace = json.loads(Path(args.trace).read_text())
    seq = accesses(trace)
    n_layers = len(trace["moe_layers"])
    total = trace["num_experts"] * n_layers
    top_k = max(len(token) for _, per_token in trace["steps"] for token in per_token)
    # cache sizes: a % of all experts, or (--slots) expert slots, e.g. what `run --show-plan` gives a budget
    unit = "slots" if args.slots else "%"
    sizes = [int(s) for s in (args.slots or args.sizes).split(",")]
    policies = list(POLICIES) + ["optimal"]
    rows = {}
    print(f"{len(seq)} expert acquisitions over {n_layers} MoE layers x {trace['num_experts']} experts")
    print(f"{'cache':>10} " + " ".join(f"{p:>10}" for p in policies))
    for size in sizes:
        slots = size if args.slots else max(1, total * size // 100)
        rows[size] = {p: simulate(seq, slots, p, n_layers, top_k) for p in policies}
        print(f"{size:>5} {unit:<4} " + " ".join(f"{100 * rows[size][p]:>9.1f}%" for p in policies))
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": sizes, "unit": unit, "hit_rates": rows}, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for p in policies:
            ax.plot(sizes, [100 * rows[s][p] for s in sizes], marker="o", label=p,
                    linestyle="--" if p == "optimal" else "-")
        ax.set_xlabel("expert cache size (expert slots)" if args.slots else "expert cache size (% of all experts)")
        ax.set_ylabel("hit rate (%)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", required=True)
    rec.add_argument("--prompt", default="def main():\n")
    rec.add_argument("--prompt-file")
    rec.add_argument("--tokens", type=int, default=128)
    rec.add_argument("--context", type=int, default=2048)
    rec.add_argument("--temperature", type=float, help="sample instead of greedy decoding (greedy text from a "
                     "random-weight checkpoint repeats itself; sampled text does not)")
    rec.add_argument("--seed", type=int, default=0, help="with --temperature")
    rec.add_argument("--out", required=True)
    rec.set_defaults(func=record)
    rep = sub.add_parser("replay")
    rep.add_argument("trace")
    rep.add_argument("--sizes", default="5,10,25,50", help="cache sizes, % of all experts")
    rep.add_argument("--slots", help="cache sizes in expert slots instead of --sizes, e.g. 151,200")
    rep.add_argument("--plot")
    rep.add_argument("--json")
    rep.set_defaults(func=replay)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
