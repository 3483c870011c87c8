"""`plan`'s report: a Plan as JSON (machine-readable, stable keys) and as text (what `offload-engine plan` prints)."""
from __future__ import annotations

from typing import Any

from ..planner import costs
from ..planner.plan import Plan
from ..planner.what_ifs import WhatIf
from ..units import format_bytes


SCENARIOS = ("no_hits", "expected", "all_hits")
ACTIVE_CONVENTION = "with_embedding_and_head"  # of params_active; the others in params_active_by_convention



def unit_bytes_by_kind(units: dict) -> dict[str, dict[str, int]]:
    """Per kind of the units placed: how many, the largest (what a slot holds) and the smallest, in bytes."""
    out: dict[str, dict[str, int]] = {}
    for key, n in units.items():
        cur = out.setdefault(key.kind, {"units": 0, "largest": 0, "smallest": n})
        cur.update(units=cur["units"] + 1, largest=max(cur["largest"], n), smallest=min(cur["smallest"], n))
    return out


def placement_summary(p: Plan) -> dict[str, Any]:
    """Per kind: where it lives and its cache slots per tier, in units and in % of the kind's units."""
    out = {}
    for kind, size in p.placement.sizes.items():
        tiers = {}
        for t in p.placement.tiers:
            n = t.slots.get(kind, 0)
            if n:
                tiers[t.name] = {"slots": n, "pct": round(100 * n / size.count, 2), "pinned": kind in t.pinned,
                                 "bytes": n * size.slot_bytes, "staging": t.staging_slots.get(kind, 0)}
        out[kind] = {"units": size.count, "slot_bytes": size.slot_bytes, "home": p.placement.home(kind),
                     "tiers": tiers}
    return out


def memory_table(p: Plan) -> dict[str, dict[str, int | None]]:
    """Per tier, everything charged to it. The engine's ledger (what --vram / --ram budget): `weights` (slots,
    `staging_slots` of them reserved for reads from the tier below), `staging` (O_DIRECT bounce buffers),
    `kv_cache`, `row_cache` (rows of a kind read by rows) and `prompt_cache` (serve --cache-ram), summed in
    `budget_charged`. Outside the ledger,
    charged here: `activations` (activation_bytes) and `reserve` (the CUDA context on the device, fixed; the OS
    and process on the host). `total` is all of it; `physical` the profile's memory (None for a CPU's compute
    pool: it shares the RAM, see plan_json's "fit")."""
    table = {}
    sizes = p.placement.sizes
    for t in p.placement.tiers:
        act = p.activations.get(t.name, 0)
        reserve = p.reserve.get(t.name, 0) if (t.name == "host" or p.profile.has_gpu) else 0
        physical = p.profile.vram_bytes if t.name == "device" else p.profile.ram_bytes
        table[t.name] = {"weights": t.slot_bytes(sizes),
                         "staging_slots": sum(n * sizes[k].slot_bytes for k, n in t.staging_slots.items()),
                         "staging": t.staging_bytes, "kv_cache": t.kv_bytes, "row_cache": t.row_cache_bytes,
                         "prompt_cache": t.prompt_cache_bytes,
                         "budget_charged": t.used(sizes), "budget": t.budget, "activations": act,
                         "reserve": reserve, "total": t.used(sizes) + act + reserve,
                         "physical": physical if (t.name == "host" or p.profile.has_gpu) else None}
    return table


def plan_json(p: Plan, what_ifs: list[WhatIf] | None = None) -> dict[str, Any]:
    s, c = p.shape.spec, p.params
    bytes_by_kind: dict[str, int] = {}
    for key, n in p.unit_bytes.items():
        if key in p.shape.schema.units:
            bytes_by_kind[key.kind] = bytes_by_kind.get(key.kind, 0) + n
    mtp_params = sum(p.shape.mtp.unit_numel(k) for k in p.shape.mtp.units) + p.shape.mtp_shared_params
    hits = p.hits["expected"].get("expert")
    out = {
        "model": {"name": _model_name(p),
                  "model_type": s.model_type, "schema": p.shape.source, "layers": s.num_layers,
                  "experts": s.num_experts, "experts_per_token": s.num_experts_per_tok},
        "params_total": c.total, "params_active": c.active, "params_active_convention": ACTIVE_CONVENTION,
        "params_active_by_convention": c.active_by_convention, "params_mtp": mtp_params,
        "params_other": dict(p.shape.extra_params), "params_by_kind": c.by_kind,
        "weights": p.fmt.name, "bytes_total": p.bytes_total, "bytes_by_kind": bytes_by_kind,
        "bytes_mtp": sum(n for k, n in p.unit_bytes.items() if k in p.shape.mtp.units),
        "unit_bytes_by_kind": unit_bytes_by_kind(p.unit_bytes),
        "hardware": p.profile.name, "hardware_description": p.profile.description,
        "context": p.options.context, "kv_dtype": p.options.kv_dtype,
        "kv_bytes_per_position": p.kv_bytes_per_position,
        "budget": {t.name: t.budget for t in p.placement.tiers},
        "direct_io": p.direct_io,
        "placement": {"summary": placement_summary(p), "tiers": [_tier_json(t) for t in p.placement.tiers]},
        "memory": memory_table(p),
        "fit": {m: {"charged": need, "physical": have, "fits": need <= have} for m, (need, have) in p.fit.items()},
        "predicted_tok_s": {k: round(p.tok_s[k], 4) for k in SCENARIOS},
        "bottleneck": p.steps["expected"].bottleneck,
        "steps": {k: p.steps[k].to_dict() for k in SCENARIOS},
        "expected_expert_hits": {"device": round(hits[0], 4), "host": round(hits[1], 4)} if hits else None,
        "locality": _locality(p),
        "spec": p.spec_info,
        "assumptions": costs.ASSUMPTIONS,
        "warnings": p.warnings,
    }
    if what_ifs is not None:
        out["what_ifs"] = [w.to_dict() for w in what_ifs]
    return out


def _conventions(c) -> str:
    a = c.active_by_convention
    return (f"embedding and head counted; {a['without_embedding'] / 1e9:.2f} B without the embedding, "
            f"{a['without_embedding_and_head'] / 1e9:.2f} B without either")


def _model_name(p: Plan) -> str:
    path = p.shape.spec.path
    if path is None:
        return p.shape.spec.model_type
    return str(path.parent) if path.name == "config.json" else path.stem


def _tier_json(t) -> dict[str, Any]:
    return {"name": t.name, "budget": t.budget, "pinned": list(t.pinned), "slots": dict(t.slots),
            "kv_bytes": t.kv_bytes, "staging_bytes": t.staging_bytes, "staging_slots": dict(t.staging_slots),
            "prompt_cache_bytes": t.prompt_cache_bytes}


def _locality(p: Plan) -> str:
    o = p.options
    if o.stats:
        return "measured hit rate (--stats / bench)"
    if o.trace is not None:
        return "routing trace, per-layer LRU simulation"
    return f"f ** {o.alpha:g} (A6: {'uniform routing' if o.alpha >= 1 else 'stated default locality'})"


def _tier_label(p: Plan, name: str) -> str:
    if name == "device":
        return "VRAM" if p.profile.has_gpu else "compute pool"
    return "RAM"


def _b(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def plan_text(p: Plan, what_ifs: list[WhatIf] | None = None) -> str:
    j, s = plan_json(p, what_ifs), p.shape.spec
    budgets = ", ".join(f"{_tier_label(p, t.name)} {_b(t.budget)}" for t in p.placement.tiers)
    lines = [f"{j['model']['name']} ({s.model_type}, {p.shape.source} schema) on {p.profile.name}: {budgets}, "
             f"context {p.options.context}, weights {p.fmt.name}, KV {p.options.kv_dtype} "
             f"({_b(p.kv_bytes_per_position)}/position)",
             f"hardware: {p.profile.describe()}" + (f"\n  {p.profile.description}" if p.profile.description else ""),
             f"parameters: {p.params.total / 1e9:.2f} B total, {p.params.active / 1e9:.2f} B active per token "
             f"({_conventions(p.params)})"
             + (f", MTP {j['params_mtp'] / 1e9:.2f} B" if j["params_mtp"] else "")
             + "".join(f", {k} {v / 1e9:.2f} B (not run)" for k, v in p.shape.extra_params.items())
             + f"; weights {_b(p.bytes_total)}" + (f" + MTP {_b(j['bytes_mtp'])}" if p.use_mtp else ""),
             "", "placement (units x slot size)"]
    for kind, info in j["placement"]["summary"].items():
        where = []
        for tier, t in info["tiers"].items():
            label = _tier_label(p, tier)
            if t["pinned"]:
                where.append(f"pinned in {label}")
            elif t["slots"] == t["staging"]:
                where.append(f"{label} staging {t['slots']} slot{'s' if t['slots'] > 1 else ''} = {_b(t['bytes'])}")
            else:
                where.append(f"{label} cache {t['slots']} slots ({t['pct']:.1f}%"
                             + (f", {t['staging']} of them staging" if t["staging"] else "")
                             + f") = {_b(t['bytes'])}")
        if p.placement.by_rows(kind):
            # the slot's few KiB of slack spread over the rows: a fraction of a byte each on real vocabularies
            row = max(info["slot_bytes"] // max(s.vocab_size, 1), 1)
            where.append(f"no slot: the rows a step looks up are read from disk ({_b(row)} per token) unless "
                         f"among the {p.placement.compute.row_cache_bytes // row} cached last")
        elif info["home"] == "disk":
            where.append("rest streamed from disk")
        lines.append(f"  {kind:<7} {info['units']:>6} x {_b(info['slot_bytes']):>10}  " + "; ".join(where))
    for t in p.placement.tiers:
        if t.staging_bytes:
            lines.append(f"  staging on {t.name}: {_b(t.staging_bytes)} (O_DIRECT bounce buffers)")
    lines.append(f"  direct I/O (page cache bypassed): {'on' if p.direct_io else 'off'}")
    mem = j["memory"]
    names = list(mem)
    lines += ["", "memory per tier".ljust(28) + "".join(f"{_tier_label(p, n):>14}" for n in names)]
    rows = (("weights", "weights"), ("  of which staging slots", "staging_slots"), ("staging (O_DIRECT)", "staging"),
            (f"KV cache ({p.options.context} tok)", "kv_cache"), ("row cache", "row_cache"),
            *((("prompt cache (--cache-ram)", "prompt_cache"),) if any(m["prompt_cache"] for m in mem.values())
              else ()),
            ("= engine ledger", "budget_charged"),
            ("  within budget", "budget"), ("activations", "activations"),
            ("reserve: CUDA ctx | process" if p.profile.has_gpu else "reserve: process", "reserve"),
            ("= total charged", "total"), ("physical", "physical"))
    for label, key in rows:
        lines.append(f"  {label:<26}" + "".join(f"{_b(mem[n][key]):>14}" for n in names))
    lines += [f"  {m}: {_b(f['charged'])} charged of {_b(f['physical'])}: {'fits' if f['fits'] else 'DOES NOT FIT'}"
              for m, f in j["fit"].items()]
    lines += ["", "decode tok/s".ljust(28) + "".join(f"{k:>12}" for k in SCENARIOS),
              "  predicted".ljust(28) + "".join(f"{p.tok_s[k]:>12.2f}" for k in SCENARIOS),
              "  bottleneck".ljust(28) + "   " + " | ".join(p.steps[k].bottleneck for k in SCENARIOS)]
    st = p.steps["expected"]
    lines.append(f"  expected step: {st.seconds * 1e3:.2f} ms = compute {st.compute_s * 1e3:.2f} + overhead "
                 f"{st.overhead_s * 1e3:.2f} + CPU experts {st.cpu_s * 1e3:.2f} + stalls {st.stall_s * 1e3:.2f} "
                 f"(PCIe {st.pcie_s * 1e3:.2f}, NVMe {st.nvme_s * 1e3:.2f}); per step {_b(st.bytes_h2d)} to the "
                 f"compute tier, {_b(st.bytes_disk)} from disk")
    if j["expected_expert_hits"]:
        h = j["expected_expert_hits"]
        lines.append(f"  expected expert hits: {_tier_label(p, p.placement.compute.name)} {100 * h['device']:.1f}%"
                     + (f", RAM {100 * h['host']:.1f}%" if p.separate_host else "") + " "
                     f"[{j['locality']}]; prefetch recall {p.options.recall:g}"
                     + (", host compute on" if p.options.host_compute else ""))
    if p.spec_info:
        si = p.spec_info
        lines.append(f"  speculation ({si['method']}): {si['drafts']} draft(s), acceptance {si['accept']:g} per "
                     f"position -> {si['accepted_per_step']:.2f} tokens per verify step of {si['tokens_per_step']}; "
                     f"experts per layer touched by 1..{si['tokens_per_step']} tokens: "
                     + " -> ".join(f"{u:g}" for u in si["expert_union_per_layer"]))
    if what_ifs:
        lines += ["", f"what-ifs (doubling = {2 * p.expected:.2f} tok/s expected):"]
        for w in what_ifs:
            mark = "x2" if w.factor and w.factor >= 2 else "  "
            figure = f"{w.tok_s:8.2f} tok/s ({w.factor:.2f}x)" if w.tok_s else "       -"
            lines.append(f"  {mark} {w.change:<62} {figure}  {w.note}".rstrip())
    if p.warnings:
        lines += [""] + [f"warning: {w}" for w in p.warnings]
    lines += ["", "assumptions (offload_engine/planner/costs.py): " + "; ".join(a.split(":")[0] for a in
                                                                          costs.ASSUMPTIONS)]
    return "\n".join(lines)
