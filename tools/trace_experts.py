#!/usr/bin/env python3
"""Record routing traces and replay them through the expert-cache policies.

  python tools/trace_experts.py record --model DIR [--prompt TEXT | --prompt-file F] --tokens 128 --out trace.json
                                      [--temperature 0.7 --seed 1]
  python tools/trace_experts.py replay trace.json --sizes 5,10,25,50 [--plot policies.png] [--json out.json]
  python tools/trace_experts.py replay trace.json --slots 151,200     # cache sizes in expert slots

A trace lists, for every forward and MoE layer, the experts each token was routed to. Replay simulates a cache
of N expert slots (N = a percentage of all experts) under each policy of offload_engine.store.policy, the same
pure functions the store uses, plus the clairvoyant optimum (Belady: evict the unit used farthest in the future)
as the reference line. Like the store, it holds a layer's resident experts while that layer's misses take
slots (simulate).
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
from offload_engine.modes import POLICIES  # noqa: E402
from offload_engine.store.policy import Usage, choose_victim  # noqa: E402


def routing_trace(model, prompts: list, tokens: int, context: int, **sampling) -> dict:
    """The model's routing over consecutive requests (one per prompt: text or token ids; greedy unless
    `sampling` says otherwise), every unit resident: the record format that FrequencyPrior (`run --trace`) and
    the planner (`plan --trace`) read."""
    from offload_engine import Engine

    with Engine.open(model, max_context=context, record_routing=True) as engine:
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


Unit = tuple[int, int]  # (layer, expert)


def acquisitions(trace: dict) -> list[list[Unit]]:
    """One list per store acquire (a forward's MoE layer), in the order the engine stamps recency:
    runtime.moe.routed_experts' (by the last token routed to each expert, then the heaviest last). A trace lists
    each token's experts in the router's rank order (heaviest first), so ranks stand in for the weights.
    Replaying in ascending expert ids instead misjudged the policies: on the bench model at 25% it gave layer-lru
    8.3 misses per token and lru 7.7, where the engine gives 6.9 and 7.6 (docs/PERF.md)."""
    out = []
    for layer, per_token in trace["steps"]:
        indices = torch.tensor(per_token, dtype=torch.long)
        ranks = torch.arange(indices.shape[1], 0, -1, dtype=torch.float32).expand(indices.shape)
        out.append([(layer, e) for e in routed_experts(indices, ranks)])
    return out


def accesses(trace: dict) -> list[Unit]:
    """Every acquisition's units, one after the other."""
    return [unit for group in acquisitions(trace) for unit in group]


def next_occurrence(seq: list[Unit]) -> list[float]:
    """nxt[t] = the next index after t at which seq[t] is accessed again (inf if never)."""
    nxt: list[float] = [float("inf")] * len(seq)
    last: dict[Unit, int] = {}
    for t in range(len(seq) - 1, -1, -1):
        nxt[t] = last.get(seq[t], float("inf"))
        last[seq[t]] = t
    return nxt


def simulate(groups: list[list[Unit]], slots: int, policy: str, n_layers: int, top_k: int = 1) -> float:
    """Hit rate of a cache of `slots` experts used as TieredStore.acquire uses it: a group's resident units are
    held while its misses take slots, so no miss evicts one of them (when only held units remain, the store
    waits for the group's units to be released: then any may go). Policy "optimal" is Belady's clairvoyant
    eviction among the same candidates. top_k: experts per token (lru-floor's floor, as the store sets it).
    On the bench model this predicts the engine's misses per token within 1-8% at 27-358 slots (docs/PERF.md);
    evicting one access at a time instead predicted lru-floor gains where the engine flooded."""
    seq = [unit for group in groups for unit in group]
    nxt = next_occurrence(seq) if policy == "optimal" else None
    cache: dict[Unit, Usage] = {}
    next_use: dict[Unit, float] = {}
    hits, t = 0, 0
    for group in groups:
        held = {unit for unit in group if unit in cache}
        for unit in group:
            if unit in cache:
                hits += 1
                u = cache[unit]
                cache[unit] = Usage(u.slot, unit[0], t, u.score + 1)
            else:
                slot = len(cache)
                if slot >= slots:
                    candidates = [k for k in cache if k not in held]
                    if not candidates:  # the store waits for this group's units to be released
                        held, candidates = set(), list(cache)
                    if policy == "optimal":
                        victim = max(candidates, key=lambda k: next_use[k])
                    else:
                        occupied: dict[int, int] = {}
                        for k in cache:
                            occupied[k[0]] = occupied.get(k[0], 0) + 1
                        by_slot = {cache[k].slot: k for k in candidates}
                        victim = by_slot[choose_victim(policy, [cache[k] for k in candidates], unit[0],
                                                       max(1, slots // n_layers), t, top_k, occupied)]
                    slot = cache.pop(victim).slot
                cache[unit] = Usage(slot, unit[0], t, 1.0)
                held.add(unit)
            if nxt is not None:
                next_use[unit] = nxt[t]
            t += 1
    return hits / len(seq) if seq else 0.0


def replay(args: argparse.Namespace) -> int:
    trace = json.loads(Path(args.trace).read_text())
    groups = acquisitions(trace)
    n_layers = len(trace["moe_layers"])
    total = trace["num_experts"] * n_layers
    top_k = max(len(token) for _, per_token in trace["steps"] for token in per_token)
    # cache sizes: a % of all experts, or (--slots) expert slots, e.g. what `run --show-plan` gives a budget
    unit = "slots" if args.slots else "%"
    sizes = [int(s) for s in (args.slots or args.sizes).split(",")]
    policies = list(POLICIES) + ["optimal"]
    rows = {}
    print(f"{sum(map(len, groups))} expert acquisitions over {n_layers} MoE layers x {trace['num_experts']} experts")
    print(f"{'cache':>10} " + " ".join(f"{p:>10}" for p in policies))
    for size in sizes:
        slots = size if args.slots else max(1, total * size // 100)
        rows[size] = {p: simulate(groups, slots, p, n_layers, top_k) for p in policies}
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
