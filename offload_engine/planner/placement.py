"""Initial placement: which units are pinned where, and how many cache slots each tier gets. A pure function.

Tiers, fastest first: the compute tier ("device": VRAM on CUDA, a budgeted RAM pool on CPU when --vram is
given) and "host" (RAM; pinned on CUDA). The checkpoint on disk is the tier below both. Every unit kind has one
slot size (its largest unit), so slots are allocated once and any unit of the kind fits any slot of the kind.

Order of preference on each tier: the KV cache (compute tier only), then whole kinds that every token needs
(dense layers, head, embeddings: pinned when all of a kind fits), then expert cache slots with what is left.
A kind that is not pinned anywhere streams through a small number of slots on the compute tier.

Row kinds (the embedding) are the exception: a forward reads one row per token of them, so holding the whole
table is worth it only where the tier then holds everything else not pinned above it too; otherwise they get no
slot at all and the store reads the rows a forward needs (TieredStore.rows). The bytes go to cache slots: a
Qwen3-30B-A3B embedding (594 MiB) is ~60 more experts on a 12 GB card; on the bench model at 25% it is 11 more
expert slots, 13% fewer misses per token (docs/PERF.md).

The staging invariant (accelerate's): each tier keeps room for the largest unit of the tier below. The compute
tier's minimum working set (MIN_STREAM_SLOTS of every kind it does not pin) holds it for units coming from the
host or the disk. When reads pass through the host on their way to the compute tier (CUDA without GPUDirect
Storage: disk -> pinned host slot -> device, store/fill.py, pinned device units included when they are loaded), `host_staging` slots of every kind are reserved on the host before anything else is placed there: one
per reader thread, so no concurrent read finds every host slot of its kind busy.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Mapping

from ..checkpoint.naming import UnitKey
from ..constants import BOUNCE_BYTES, DIRECT_SLACK, PAGE, READER_THREADS
from ..errors import BudgetError, ConfigError
from ..modes import DIRECT_IO_MODES
from ..units import format_bytes

ALWAYS_NEEDED = ("dense", "head", "embed", "mtp")  # pinned first, in this order, when a whole kind fits
MIN_STREAM_SLOTS = {"dense": 2, "expert": 2, "head": 1, "mtp": 1}  # two allow a read during compute
ROW_KINDS = ("embed",)  # read by rows where not pinned (no slots); pinned only on a tier that holds all the rest
# A kind read by rows keeps the rows it looked up last in a cache on the compute tier (store.rows.RowCache): a
# decode step looks up the token just sampled, and text repeats its tokens. This many bytes, at most 1/64 of the
# tier's budget; taken from the expert cache when the tier is full (rows every step needs beat one more expert).
ROW_CACHE_BYTES = 4 << 20


@dataclass(frozen=True)
class ResolvedBudget:
    """Budgets in bytes per tier (config.Budget resolved against the model's size); None: not limited."""
    device: int | None
    host: int | None


@dataclass(frozen=True)
class KindSize:
    kind: str
    count: int  # units of this kind
    slot_bytes: int  # largest unit of this kind


SLOT_ALIGN = 64  # slot sizes are multiples of this: slots sliced from one region keep typed views aligned
# Slots of at least this size are whole pages (at most 0.4% more), so in a page-aligned region (store.hostmem) each
# slot starts a page: a weight row that straddles pages makes the CPU's prefetchers, which stop at page
# boundaries, restart mid-row (an fp32 expert of 4 KiB rows: 266-271 us per decode call vs 249-251; store.disk's
# read_unit_direct has the figures)
PAGE_SLOT_FROM = 1 << 20


def kind_sizes(units: Mapping[UnitKey, int], slack: int = 0) -> dict[str, KindSize]:
    """Per kind, the unit count and every slot's size: the largest unit plus `slack` (direct I/O's page slack),
    rounded up to SLOT_ALIGN, or to whole pages from PAGE_SLOT_FROM."""
    sizes: dict[str, KindSize] = {}
    for key, n in units.items():
        cur = sizes.get(key.kind)
        sizes[key.kind] = KindSize(key.kind, (cur.count if cur else 0) + 1,
                                   max(cur.slot_bytes if cur else 0, slot_size(n + slack)))
    return sizes


def slot_size(nbytes: int) -> int:
    align = PAGE if nbytes >= PAGE_SLOT_FROM else SLOT_ALIGN
    return -(-nbytes // align) * align


@dataclass
class TierPlan:
    name: str
    budget: int | None  # None: not limited by the user
    pinned: list[str] = field(default_factory=list)  # kinds held whole on this tier
    slots: dict[str, int] = field(default_factory=dict)  # kind -> cache slots (pinned kinds: one per unit)
    kv_bytes: int = 0
    staging_bytes: int = 0  # O_DIRECT bounce buffers
    staging_slots: dict[str, int] = field(default_factory=dict)  # kind -> slots reserved for reads from below
    row_cache_bytes: int = 0  # rows of a kind read by rows, cached (ROW_CACHE_BYTES)
    prompt_cache_bytes: int = 0  # saved prompt prefixes' KV (serve --cache-ram; generate/prompt_cache.py)

    def slot_bytes(self, sizes: dict[str, KindSize]) -> int:
        return sum(n * sizes[k].slot_bytes for k, n in self.slots.items())

    def used(self, sizes: dict[str, KindSize]) -> int:
        return (self.slot_bytes(sizes) + self.kv_bytes + self.staging_bytes + self.row_cache_bytes
                + self.prompt_cache_bytes)

    def caches(self, kind: str) -> bool:
        """Whether this tier keeps units of `kind` beyond the staging slots reads pass through."""
        return self.slots.get(kind, 0) > self.staging_slots.get(kind, 0)


@dataclass
class Placement:
    sizes: dict[str, KindSize]
    tiers: list[TierPlan]  # compute tier first

    @property
    def compute(self) -> TierPlan:
        return self.tiers[0]

    def home(self, kind: str) -> str:
        for t in self.tiers:
            if kind in t.pinned:
                return t.name
        return "disk"

    def host_caches(self, kind: str) -> bool:
        """Whether a host tier apart from the compute tier keeps units of `kind` beyond its staging slots (what
        GPUDirect reads around, and what host compute needs)."""
        return len(self.tiers) > 1 and self.tiers[1].caches(kind)

    def by_rows(self, kind: str) -> bool:
        """Whether the store reads this kind's rows from the checkpoint on demand (a row kind pinned nowhere)."""
        return kind in ROW_KINDS and self.home(kind) == "disk"

    @property
    def streams(self) -> bool:
        """Whether some kind of unit is read whole from the checkpoint while decoding (pinned in no tier); a row
        kind read by rows (one small read per step) does not count: there is nothing to read ahead."""
        return any(self.home(kind) == "disk" and not self.by_rows(kind) for kind in self.sizes)

    def to_json(self) -> str:
        return json.dumps({"sizes": {k: asdict(v) for k, v in self.sizes.items()},
                           "tiers": [asdict(t) for t in self.tiers]}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Placement":
        data = json.loads(text)
        return cls({k: KindSize(**v) for k, v in data["sizes"].items()}, [TierPlan(**t) for t in data["tiers"]])

    def validate(self) -> None:
        for t in self.tiers:
            if t.budget is not None and t.used(self.sizes) > t.budget:
                raise BudgetError(t.name, t.used(self.sizes), t.budget, self.breakdown(t))
        for kind, size in self.sizes.items():
            if self.home(kind) == "disk" and not self.by_rows(kind) and self.compute.slots.get(kind, 0) < 1:
                raise BudgetError(self.compute.name, size.slot_bytes, 0, {f"{kind} slot": size.slot_bytes})
            for t in self.tiers:
                if t.slots.get(kind, 0) < t.staging_slots.get(kind, 0):
                    raise BudgetError(t.name, t.staging_slots[kind] * size.slot_bytes,
                                      t.slots.get(kind, 0) * size.slot_bytes, {f"{kind} staging": size.slot_bytes})

    def breakdown(self, t: TierPlan) -> dict[str, int]:
        out = {f"{k} x{n}": n * self.sizes[k].slot_bytes for k, n in t.slots.items() if n}
        if t.kv_bytes:
            out["kv cache"] = t.kv_bytes
        if t.staging_bytes:
            out["staging"] = t.staging_bytes
        if t.row_cache_bytes:
            out["row cache"] = t.row_cache_bytes
        if t.prompt_cache_bytes:
            out["prompt cache"] = t.prompt_cache_bytes
        return out

    def describe(self) -> str:
        lines = []
        for t in self.tiers:
            budget = "unlimited" if t.budget is None else format_bytes(t.budget)
            lines.append(f"{t.name}: {format_bytes(t.used(self.sizes))} of {budget}")
            for kind, n in t.slots.items():
                size = self.sizes[kind]
                what = "pinned" if kind in t.pinned else f"cache {100 * n / max(size.count, 1):.0f}% of {kind} units"
                if t.staging_slots.get(kind):
                    what += f", {t.staging_slots[kind]} reserved as staging"
                lines.append(f"  {kind:<7} {n:>5} x {format_bytes(size.slot_bytes):>11}  {what}")
            if t.kv_bytes:
                lines.append(f"  kv cache        {format_bytes(t.kv_bytes):>11}")
            if t.staging_bytes:
                lines.append(f"  staging         {format_bytes(t.staging_bytes):>11}")
            if t.row_cache_bytes:
                lines.append(f"  row cache       {format_bytes(t.row_cache_bytes):>11}")
            if t.prompt_cache_bytes:
                lines.append(f"  prompt cache    {format_bytes(t.prompt_cache_bytes):>11}  (--cache-ram)")
        streamed = [k + (" (rows)" if self.by_rows(k) else "") for k in self.sizes if self.home(k) == "disk"]
        lines.append(f"disk: {', '.join(streamed) if streamed else 'nothing streamed'}")
        return "\n".join(lines)


MIN_BOUNCE = 64 * 1024
STAGING_SHARE = 8  # the O_DIRECT bounce buffers take at most 1/8 of the budget of the tier that holds them


def bounce_bytes(sizes: Mapping[str, KindSize], budget: int | None = None) -> int:
    """O_DIRECT bounce buffer per reader thread: the largest unit plus alignment slack, at most BOUNCE_BYTES, and
    with a `budget`, at most its 1/STAGING_SHARE over the readers (never under MIN_BOUNCE): a small budget reads
    in smaller aligned pieces rather than spending most of itself on staging."""
    largest = max(s.slot_bytes for s in sizes.values())
    size = min(BOUNCE_BYTES, -(-largest // PAGE) * PAGE + PAGE)
    if budget is not None:
        size = min(size, max(MIN_BOUNCE, budget // (STAGING_SHARE * READER_THREADS) // PAGE * PAGE))
    return size


def place(units: Mapping[UnitKey, int], *, device_budget: int | None, host_budget: int | None, kv_bytes: int,
          direct_io: str, gpu: bool, prompt_cache_bytes: int = 0) -> tuple[Placement, bool]:
    """The placement the store executes, and whether it reads with O_DIRECT: the one decision `plan` predicts
    and Engine.open builds (both call this, so they cannot drift).

    units: bytes of every unit the store will hold. device_budget: the compute tier apart from the host tier
    (VRAM on a GPU, resolved by the caller: a profile's figure or the free memory; on a CPU, a RAM pool set by
    --vram); None without a GPU: one RAM tier. host_budget: the host tier (None: unbounded). gpu: the compute
    tier is a GPU's memory, so disk reads pass through host slots on their way to it. direct_io: auto (on when
    the weights exceed host_budget), on or off. prompt_cache_bytes: charged to the host tier (serve --cache-ram)."""
    if direct_io not in DIRECT_IO_MODES:
        raise ConfigError(f"--direct-io must be {', '.join(DIRECT_IO_MODES)}, got {direct_io!r}")
    use_direct = direct_io == "on" or (direct_io == "auto" and host_budget is not None
                                       and host_budget < sum(units.values()))
    # every slot an O_DIRECT read lands in straight carries its page slack (store.disk.read_unit_direct)
    sizes = kind_sizes(units, DIRECT_SLACK if use_direct else 0)
    staging = READER_THREADS * bounce_bytes(sizes, host_budget) if use_direct else 0
    if gpu or device_budget is not None:
        # GPU reads pass through host slots (the store's read via host): one per reader thread and kind, so a
        # read never finds every host slot of its kind taken
        placement = plan_placement(sizes, device_budget, host_budget, kv_bytes, staging, separate_host=True,
                                   host_staging=READER_THREADS if gpu else 0, prompt_cache_bytes=prompt_cache_bytes)
    else:
        placement = plan_placement(sizes, host_budget, None, kv_bytes, staging, separate_host=False,
                                   prompt_cache_bytes=prompt_cache_bytes)
    return placement, use_direct


def plan_placement(sizes: dict[str, KindSize], compute_budget: int | None, host_budget: int | None,
                   kv_bytes: int, staging_bytes: int = 0, separate_host: bool = True,
                   host_staging: int = 0, prompt_cache_bytes: int = 0) -> Placement:
    """separate_host=False: one RAM tier (CPU without --vram): compute reads the host tier directly.
    host_staging: host slots reserved per kind (at most its unit count) for reads that pass through the host
    (GPU: constants.READER_THREADS); 0: reads land in compute-tier slots directly (CPU)."""
    compute = TierPlan("device" if separate_host else "host", compute_budget, kv_bytes=kv_bytes)
    tiers = [compute]
    if separate_host:
        tiers.append(TierPlan("host", host_budget, staging_bytes=staging_bytes))
    else:
        compute.staging_bytes = staging_bytes
    tiers[-1].prompt_cache_bytes = prompt_cache_bytes  # snapshots live in host memory, whatever computes
    placement = Placement(sizes, tiers)
    # The minimum working set: stream slots for every kind on the compute tier (row kinds need none).
    minimum = {k: MIN_STREAM_SLOTS[k] if s.count > 1 else 1 for k, s in sizes.items()
               if s.count and k not in ROW_KINDS}
    compute.slots = dict(minimum)
    need = compute.used(sizes)
    if compute.budget is not None and need > compute.budget:
        raise BudgetError(compute.name, need, compute.budget, placement.breakdown(compute),
                          hint="the minimum working set: streaming slots for each unit kind, the KV cache, staging, "
                               "the prompt cache (--cache-ram)")
    if separate_host and host_staging > 0:
        host = tiers[1]
        # row kinds load through the host only when the compute tier will hold them (and so everything)
        whole = _holds_all(compute, sizes, placement, None if compute.budget is None else compute.budget - need)
        host.staging_slots = {k: min(host_staging, s.count) for k, s in sizes.items()
                              if s.count and (whole or k not in ROW_KINDS)}
        host.slots = dict(host.staging_slots)
        need = host.used(sizes)
        if host.budget is not None and need > host.budget:
            raise BudgetError("host", need, host.budget, placement.breakdown(host),
                              hint=f"reads go disk -> host -> device: the host keeps {host_staging} staging slots "
                                   f"of each unit kind (one per reader thread) and the O_DIRECT buffers")

    for tier in tiers:
        free = None if tier.budget is None else tier.budget - tier.used(sizes)
        for kind in ALWAYS_NEEDED + ("expert",):
            size = sizes.get(kind)
            if size is None or not size.count or placement.home(kind) != "disk":
                continue
            have = tier.slots.get(kind, 0)
            extra = size.count - have
            if kind in ROW_KINDS:
                if _holds_all(tier, sizes, placement, free):
                    tier.slots[kind] = size.count
                    tier.pinned.append(kind)
                    free = None if free is None else free - extra * size.slot_bytes
                continue
            if free is None or extra * size.slot_bytes <= free:
                tier.slots[kind] = size.count
                tier.pinned.append(kind)
                free = None if free is None else free - extra * size.slot_bytes
            elif kind == "expert" or tier is not compute:
                # a partial cache: as many slots as fit (expert caches always; other kinds on lower tiers)
                n = free // size.slot_bytes
                if n + have > 0:
                    tier.slots[kind] = have + n
                    free -= n * size.slot_bytes
    if any(placement.by_rows(k) for k, s in sizes.items() if s.count):
        _reserve_row_cache(compute, sizes)
    placement.validate()
    return placement


def _reserve_row_cache(tier: TierPlan, sizes: dict[str, KindSize]) -> None:
    """ROW_CACHE_BYTES (at most 1/64 of the budget) for the row cache: from the tier's free bytes, else from its
    expert cache, never below the minimum working set."""
    if tier.budget is None:
        tier.row_cache_bytes = ROW_CACHE_BYTES
        return
    want = min(ROW_CACHE_BYTES, tier.budget // 64)
    free = tier.budget - tier.used(sizes)
    expert = sizes.get("expert")
    while (free < want and expert is not None and "expert" not in tier.pinned
           and tier.slots.get("expert", 0) > MIN_STREAM_SLOTS["expert"]):
        tier.slots["expert"] -= 1
        free += expert.slot_bytes
    tier.row_cache_bytes = max(0, min(want, free))


def _holds_all(tier: TierPlan, sizes: dict[str, KindSize], placement: Placement, free: int | None) -> bool:
    """Whether `free` bytes of `tier` (None: unlimited) hold every unit pinned on no tier yet, beyond the slots
    the tier has already."""
    if free is None:
        return True
    rest = sum((s.count - tier.slots.get(k, 0)) * s.slot_bytes for k, s in sizes.items()
               if s.count and placement.home(k) == "disk")
    return rest <= free
