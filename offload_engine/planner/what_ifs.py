"""`plan`'s what-ifs: the changes a user can make, each planned, the smallest that doubles the expected speed first.

Only what a user controls: a flag (--ram / --vram up to what the hardware has, --kv-dtype, --context, --spec,
--host-compute), a format (`quantize --weights`), or another machine named in configs/hardware (--hardware).
Never a made-up machine: no "VRAM x 12", no bandwidth x2 (issue 46 item 5).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import BudgetError, ConfigError
from ..units import format_bytes
from .formats import FORMAT_BITS
from .hardware import HardwareProfile, list_profiles, load_profile
from .plan import Plan, plan

# a what-if row (what_ifs finds them: the smallest change that doubles the speed first)
@dataclass(frozen=True)
class WhatIf:
    change: str
    tok_s: float | None  # expected decode tok/s after the change; None: infeasible
    factor: float | None
    bottleneck: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"change": self.change, "tok_s": None if self.tok_s is None else round(self.tok_s, 4),
                "factor": None if self.factor is None else round(self.factor, 3), "bottleneck": self.bottleneck,
                "note": self.note, "doubles": bool(self.factor and self.factor >= 2)}


BUDGET_STEPS = (1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 32)
CONTEXT_STEPS = (2, 4, 8)  # --context divided by these
SMALLEST_CONTEXT = 512
QUANTIZE_FORMATS = ("int8", "int4")  # what `offload-engine quantize --weights` writes (fp8 sizes like int8)


def flag_size(n: int) -> tuple[str, int]:
    """A budget as a flag value a user can type (GiB, one decimal, rounded down) and the bytes it stands for."""
    tenths = math.floor(n / 2**30 * 10)
    if tenths < 1:
        mib = max(n >> 20, 1)
        return f"{mib}MiB", mib << 20
    return f"{tenths / 10:g}GiB", tenths * 2**30 // 10


def budget_caps(base: Plan) -> dict[str, int]:
    """The largest --ram / --vram this hardware holds beside the reserves and activations (plan()'s defaults)."""
    prof, act = base.profile, base.activations
    caps = {"host": prof.ram_bytes - base.reserve["host"] - act.get("host", 0)}
    if prof.has_gpu:
        caps["device"] = prof.vram_bytes - base.reserve["device"] - act.get("device", 0)
    elif base.separate_host:  # a CPU's compute pool (--vram) shares the RAM
        caps["host"] -= base.placement.compute.budget or 0
    return caps


def what_ifs(base: Plan) -> list[WhatIf]:
    """Each change a user can make, planned: --ram / --vram (the smallest step of BUDGET_STEPS that doubles the
    speed, at most what the hardware holds), a smaller --context, --kv-dtype int8, --spec mtp, --host-compute,
    a quantized copy, and each other shipped hardware profile with its default budgets."""
    shape, prof, o = base.shape, base.profile, base.options
    out: list[WhatIf] = []

    def attempt(change: str, profile: HardwareProfile = prof, note: str = "", **opts: Any) -> WhatIf:
        try:
            p = plan(shape, profile, dataclasses.replace(o, **opts))
        except (BudgetError, ConfigError) as e:
            return WhatIf(change, None, None, note=f"infeasible: {e}")
        misfit = [m for m, (need, have) in p.fit.items() if need > have]
        note = "; ".join(filter(None, [note] + [f"{m} does not fit" for m in misfit]))
        return WhatIf(change, p.expected, p.expected / base.expected, p.steps["expected"].bottleneck, note)

    caps = budget_caps(base)
    needed = sum(base.unit_bytes.values()) + base.kv_bytes  # every unit resident, nothing streamed
    for tier, flag in (("host", "--ram"), ("device", "--vram")):
        t = next((x for x in base.placement.tiers if x.name == tier), None)
        if t is None or t.budget is None or tier not in caps or t.budget >= caps[tier]:
            continue
        if all(k in t.pinned for k in base.placement.sizes) or (tier == "host" and all(
                base.placement.home(k) != "disk" for k in base.placement.sizes)):
            continue  # this tier already holds everything it could
        tried = None
        for step in BUDGET_STEPS:
            text, new = flag_size(min(int(t.budget * step), caps[tier]))
            if new <= t.budget:
                continue
            other = {"vram": base.placement.compute.budget if base.separate_host else None} if tier == "host" \
                else {"ram": base.placement.tiers[-1].budget}
            tried = attempt(f"{flag} {text} (from {format_bytes(t.budget)})", **{flag[2:]: new}, **other)
            if (tried.factor and tried.factor >= 2) or new >= caps[tier] or new > needed:
                break
        if tried:
            out.append(tried)
    tried = None
    for div in CONTEXT_STEPS:  # the smallest cut that doubles the speed, else the largest cut tried
        context = o.context // div
        if context < SMALLEST_CONTEXT:
            break
        tried = attempt(f"--context {context} (from {o.context})", context=context,
                        position=None if o.position is None else min(o.position, context - 1))
        if tried.factor and tried.factor >= 2:
            break
    if tried:
        out.append(tried)
    if o.kv_dtype in ("auto", "bf16"):
        out.append(attempt("--kv-dtype int8 (one byte per KV value)", kv_dtype="int8"))
    if shape.mtp.units and o.spec == "off":
        out.append(attempt("--spec mtp (its MTP layers draft)", spec="mtp"))
    if prof.has_gpu and not o.host_compute and shape.moe_layers:
        out.append(attempt("--host-compute (experts in RAM run on the CPU)", host_compute=True))
    for name in QUANTIZE_FORMATS:
        if max(base.fmt.expert_bits, base.fmt.dense_bits) > FORMAT_BITS[name] + 0.5:
            out.append(attempt(f"--weights {name} (a copy: quantize --weights {name})", weights=name))
    for name in list_profiles():
        other = load_profile(name)
        if other.name != prof.name:
            out.append(attempt(f"--hardware {name}", other, note="its default budgets", vram=None, ram=None))
    return out
