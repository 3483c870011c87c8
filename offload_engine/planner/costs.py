"""The cost model: seconds per decode step from what a step touches, where it lives, and a HardwareProfile.

Everything here is a pure function of numbers; `plan.py` derives the numbers from the placement. The
assumptions, each printed with the plan (ASSUMPTIONS):

A1 Decode is memory-bound at batch 1: computing a unit costs max(bytes / weight bandwidth, 2 * params *
   tokens / FLOPs) on the tier that computes it (device memory bandwidth on a GPU, CPU GEMV bandwidth on the
   host), plus a fixed dispatch cost for each of the unit's ops (OPS_PER_UNIT x gpu_op_us or cpu_op_us) and
   the engine's Python bookkeeping per acquired unit (acquire, release, tensor views, routing glue), which
   costs as much as ENGINE_UNIT_OPS small torch ops on the host CPU (ENGINE_UNIT_OPS x cpu_op_us; measured
   on the CPU engine). Attention also reads the KV cache. A CPU computing a bf16 checkpoint's plain experts runs
   the engine's native kernels (runtime/kernels/decode.py; a CPU that multiplies bf16 natively is assumed, as for
   the KV cache's itemsize): a layer's resident routed experts go in one call, so an expert costs
   NATIVE_EXPERT_OPS instead of its OPS_PER_UNIT. Where the whole model is pinned on such a CPU (nothing
   streams) and its architecture keeps the standard block with routed experts alone (ONE_CALL_ARCHS), a step's
   layers go in one native call (runtime/decode_plan.py): dense and expert units cost their bytes only.
A2 A unit missing from the compute tier crosses one link per tier: host -> device (PCIe on a GPU box, a RAM
   copy on a CPU engine with --vram) if it is in RAM, disk -> host -> device otherwise. A disk read costs
   nvme_latency_us / READER_THREADS + bytes / nvme_gbps, plus bytes / ram_gbps with direct I/O for units that
   are not one contiguous range in their shard (dense layers; fused [E, ...] experts): the reader copies each
   O_DIRECT chunk from its aligned bounce buffer into the slot. A one-range unit (an expert of a per-expert
   checkpoint) is read straight into its slot.
A3 The store's reader pool (READER_THREADS threads) pipelines the links: link time = max(NVMe, PCIe), not the sum.
A4 Overlap: reads of missing experts start when the layer's routing is known and overlap only that layer's
   compute of its other experts ("resident first"), one read after another on the link. A layer that misses n
   of its u experts (n as counted replaying a routing trace through the caches when one is given, else
   Poisson-distributed around the step's mean misses per layer) waits
   max(0, n * read - (u - 1) * per_expert, read - (u - n) * per_expert) (per_expert: its compute and
   bookkeeping; the resident ones first, then each arrival as it lands: the last arrival, or the first one when
   there is too little resident work to cover it, sets the end). A fraction `recall` of expert reads (the
   prefetcher's effective recall) and every dense-layer read (when a prefetcher runs) are issued a layer ahead
   and overlap earlier compute:
   t = max(C + dense demand + sum of the layers' waits, link time).
A5 With host compute, routed experts not resident on the device run on the CPU where they live (no PCIe copy):
   CPU GEMV bandwidth + cpu_op_us per op, concurrently with the GPU's work on resident experts.
A6 Hit rates. Dense layers are scanned in order: a partial cache of n < L slots keeps n - 1 of them under
   layer-lru (it evicts the lowest layer). Routed experts: a cache holding a fraction f of a layer's experts
   serves f ** alpha of its uses. alpha = 1 is uniform routing (no locality); DEFAULT_ALPHA = 0.4 is a stated
   middle ground: published LRU traces on Qwen3-30B-A3B and Qwen3.6-35B-A3B (FIELD-NOTES: 70-85% hits at
   20-65% of experts cached) imply alpha 0.2-0.35. A routing trace (--trace) replaces it with a simulation.
A7 Speculation: a verify step of m tokens touches the union of their experts, N * (1 - (1 - k/N) ** m) per
   layer (independent tokens: an upper bound), and accepts 1 + a + ... + a**d tokens (chain of d drafts,
   per-position acceptance a).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

from ..constants import READER_THREADS
from .hardware import HardwareProfile

DEFAULT_ALPHA = 0.4
DEFAULT_RECALL = 0.0  # conservative: no read hidden by prefetching (router lookahead: 0.886 on Qwen3-30B-A3B)
# engine bookkeeping per unit in small-op equivalents, on the layer loop (a budget that streams: the resident
# one-call decode pays none, A1). Re-fitted 2026-12-07 (session 24) on the bf16 bench checkpoint at 25%, 2 threads,
# probe cpu_op_us 3.15: predicted with the engine's measured hits 50.6 tok/s at 14 where it ran 35.9, ~8 ms a
# token more; 38 (120 us a unit use on that path, not broken down further) predicts 36.3 (docs/CALIBRATION.md).
# Earlier: 14 (2026-12-06, resident fp32, when the resident loop still paid it), 80 (session 2).
ENGINE_UNIT_OPS = 38.0
OPS_PER_UNIT = {"embed": 2, "dense": 22, "expert": 9, "head": 4, "mtp": 26}  # torch ops per unit (decode)
# an expert's share of its layer's one native call (A1), fitted on the bf16 bench checkpoint the same day: 18.2
# ms/token = 9.9 ms GEMV + the dense units' ops + 110 units' bookkeeping + ~0.7 op per expert
NATIVE_EXPERT_OPS = 1.0
# A1's one-call decode: the architectures whose runtime ops keep StandardOps' attention block and routing
# (runtime/decode_plan.py arch_fits; tests/test_decode_plan.py checks the two agree)
ONE_CALL_ARCHS = frozenset({"llama", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})

ASSUMPTIONS = [" ".join(item.split()) for item in re.split(r"\n(?=A\d )", __doc__.split("(ASSUMPTIONS):")[1].strip())]


@dataclass(frozen=True)
class Flow:
    """Uses of one kind of unit in one step, and where a use finds the unit."""

    kind: str
    uses: float  # units of this kind computed per step
    unit_bytes: float  # mean bytes of one unit
    unit_params: float  # mean parameters of one unit
    tokens: float  # tokens each use processes (flops)
    p_device: float  # found on the compute tier
    p_host: float  # found on the host tier, not on the compute tier
    groups: int = 1  # layers the uses are spread over (overlap is within a layer)
    compute_bytes: float | None = None  # bytes one use reads when computed (default unit_bytes; embedding: a row)
    miss_hist: tuple[float, ...] | None = None  # experts: P(a layer misses n of its uses), n = 0, 1, ... (A4)

    @property
    def p_disk(self) -> float:
        return max(0.0, 1.0 - self.p_device - self.p_host)


@dataclass(frozen=True)
class Machine:
    """The rates of one execution setup, from a profile and the tier layout."""

    compute: str  # "gpu" | "cpu"
    weight_gbps: float  # compute tier reading weights
    flops: float  # compute tier, FLOP/s
    op_us: float
    h2d_gbps: float | None  # host tier -> compute tier; None: one tier (the compute tier is the host)
    nvme_gbps: float
    nvme_latency_us: float
    cpu_gbps: float
    cpu_flops: float
    cpu_op_us: float
    native_experts: bool = False  # A1: a CPU computing plain bf16 experts with the engine's grouped kernel
    one_call: bool = False  # A1: a CPU decoding every layer in one native call (the whole model pinned)

    @classmethod
    def of(cls, profile: HardwareProfile, separate_host: bool, native_experts: bool = False,
           one_call: bool = False) -> "Machine":
        """native_experts: the experts are plain bf16; one_call: the layers of a step go in one native call (both
        ignored with a GPU, whose layers the CPU does not compute)."""
        if profile.has_gpu:
            return cls("gpu", profile.gpu_mem_gbps, profile.gpu_tflops * 1e12, profile.gpu_op_us, profile.pcie_gbps,
                       profile.nvme_gbps, profile.nvme_latency_us, profile.cpu_gemv_gbps, profile.cpu_gflops * 1e9,
                       profile.cpu_op_us)
        return cls("cpu", profile.cpu_gemv_gbps, profile.cpu_gflops * 1e9, profile.cpu_op_us,
                   profile.ram_gbps if separate_host else None, profile.nvme_gbps, profile.nvme_latency_us,
                   profile.cpu_gemv_gbps, profile.cpu_gflops * 1e9, profile.cpu_op_us, native_experts, one_call)


@dataclass(frozen=True)
class StepCost:
    seconds: float
    compute_s: float  # weights (and KV) through the compute tier: max(bandwidth, FLOPs) per unit
    overhead_s: float  # per-op dispatch and per-unit bookkeeping
    cpu_s: float  # experts computed on the CPU (host compute)
    pcie_s: float  # host -> compute tier copies (PCIe, or RAM copies on a CPU engine)
    nvme_s: float  # disk reads
    stall_s: float  # link time not hidden behind compute
    bytes_h2d: float
    bytes_disk: float
    bottleneck: str

    def to_dict(self) -> dict:
        return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def hit_fraction(cached_fraction: float, alpha: float) -> float:
    """A6: the share of uses a cache holding `cached_fraction` of the units serves."""
    f = min(max(cached_fraction, 0.0), 1.0)
    return 1.0 if f >= 1.0 else f ** alpha if f > 0 else 0.0


def scan_hit_fraction(slots: int, count: int) -> float:
    """A6: a kind read in order every step (dense layers) through `slots` < `count` slots under layer-lru."""
    return 1.0 if slots >= count else max(slots - 1, 0) / count


def union_share(n_experts: int, k: int, tokens: float) -> float:
    """A7: the share of a layer's experts that `tokens` independently routed tokens touch (k of n each)."""
    return 1.0 - (1.0 - k / n_experts) ** tokens


def expert_union(n_experts: int, k: int, tokens: float) -> float:
    """A7: expected distinct experts per layer touched by `tokens` independently routed tokens."""
    if n_experts <= 0 or k <= 0:
        return 0.0
    return n_experts * union_share(n_experts, k, tokens)


def accepted_per_step(drafts: int, accept: float) -> float:
    """A7: expected tokens accepted per verify step (bonus token included) for a chain of `drafts`."""
    return sum(accept ** j for j in range(drafts + 1))


def expert_host_seconds(nbytes: float, params: float, tokens: float, m: Machine, overhead_scale: float = 1.0) -> float:
    """A5: one expert computed on the host CPU where it lives in RAM: GEMV bandwidth or FLOPs, plus its ops."""
    return (max(nbytes / (m.cpu_gbps * 1e9), 2 * params * tokens / m.cpu_flops)
            + overhead_scale * OPS_PER_UNIT["expert"] * m.cpu_op_us * 1e-6)


def expert_copied_seconds(nbytes: float, params: float, tokens: float, m: Machine) -> float:
    """A2 + A1: one expert copied host -> device, then computed on the device."""
    return (nbytes / (m.h2d_gbps * 1e9) + max(nbytes / (m.weight_gbps * 1e9), 2 * params * tokens / m.flops)
            + OPS_PER_UNIT["expert"] * m.op_us * 1e-6)


def host_compute_pays(nbytes: float, params: float, tokens: float, m: Machine,
                      observed_host_s: float | None = None) -> bool:
    """The one rule for computing a host-resident expert on the CPU instead of copying it to the GPU (the planner's
    A5 and the engine's `host_compute="auto"`): only with a GPU and a host tier, only where it is faster.
    `observed_host_s`: what an expert computed on the host took in this engine, where larger than the estimate
    (the probes run on an idle CPU; in decode the readers, the GPU's dispatch and torch's thread pool share it)."""
    if m.compute != "gpu" or m.h2d_gbps is None:
        return False
    host = max(expert_host_seconds(nbytes, params, tokens, m), observed_host_s or 0.0)
    return host < expert_copied_seconds(nbytes, params, tokens, m)


def step_cost(flows: list[Flow], m: Machine, *, recall: float = DEFAULT_RECALL, host_compute: bool = False,
              kv_read_bytes: float = 0.0, prefetch_dense: bool | None = None,
              overhead_scale: float = 1.0, bounce_gbps: float | None = None,
              bounced: tuple[str, ...] = ("dense", "expert")) -> StepCost:
    """Seconds for one step (A1-A5). `kv_read_bytes`: KV cache bytes attention reads in the step;
    `overhead_scale` multiplies every dispatch and bookkeeping cost (0: the bound the hardware sets);
    `bounce_gbps`: with direct I/O, the rate of the reader's bounce-buffer copy for the `bounced` sides (A2)."""
    prefetch_dense = recall > 0 if prefetch_dense is None else prefetch_dense
    compute = kv_read_bytes / (m.weight_gbps * 1e9)
    overhead = cpu = 0.0
    h2d = {"dense": 0.0, "expert": 0.0}
    disk = {"dense": 0.0, "expert": 0.0}
    reads = {"dense": 0.0, "expert": 0.0}
    expert_compute = overlappable = cpu_disk_misses = 0.0
    layers: list[tuple[float, float, float, float, tuple[float, ...] | None]] = []  # per expert flow:
    # (groups, misses, uses, seconds per use, miss histogram)
    for f in flows:
        side = "expert" if f.kind == "expert" else "dense"
        read = f.unit_bytes if f.compute_bytes is None else f.compute_bytes
        per_unit = max(read / (m.weight_gbps * 1e9), 2 * f.unit_params * f.tokens / m.flops)
        ops = NATIVE_EXPERT_OPS if f.kind == "expert" and m.native_experts else OPS_PER_UNIT.get(f.kind, 8)
        unit_ops = ENGINE_UNIT_OPS
        if m.one_call and f.kind in ("dense", "expert"):  # no Python and no dispatch of their own
            ops = unit_ops = 0.0
        on_cpu = host_compute and f.kind == "expert" and m.compute == "gpu"
        missing = f.uses * (f.p_host + f.p_disk)
        from_disk = f.uses * f.p_disk
        if on_cpu:  # A5: misses computed where they live (RAM); disk misses land in RAM first
            gpu_uses = f.uses * f.p_device
            cpu_unit = expert_host_seconds(read, f.unit_params, f.tokens, m, overhead_scale)
            cpu += missing * cpu_unit
            overlappable += max(missing * cpu_unit - (f.groups * cpu_unit if missing else 0.0), 0.0)
            cpu_disk_misses += from_disk
        else:
            gpu_uses = f.uses
            if m.h2d_gbps is not None:
                h2d[side] += missing * f.unit_bytes
        disk[side] += from_disk * f.unit_bytes
        reads[side] += from_disk
        compute += gpu_uses * per_unit
        overhead += overhead_scale * (gpu_uses * ops * m.op_us + f.uses * unit_ops * m.cpu_op_us) * 1e-6
        if f.kind == "expert":
            expert_compute += gpu_uses * per_unit
            if not on_cpu:
                per_use = per_unit + overhead_scale * (ops * m.op_us + unit_ops * m.cpu_op_us) * 1e-6
                layers.append((f.groups, missing, f.uses, per_use, f.miss_hist))

    def link_s(side: str) -> tuple[float, float]:
        pcie = h2d[side] / (m.h2d_gbps * 1e9) if m.h2d_gbps else 0.0
        nvme = disk[side] / (m.nvme_gbps * 1e9) + reads[side] * m.nvme_latency_us * 1e-6 / READER_THREADS
        if bounce_gbps and side in bounced:
            nvme += disk[side] / (bounce_gbps * 1e9)
        return pcie, nvme

    (pcie_d, nvme_d), (pcie_e, nvme_e) = link_s("dense"), link_s("expert")
    link_dense, link_expert = max(pcie_d, nvme_d), max(pcie_e, nvme_e)  # A3
    pcie, nvme = pcie_d + pcie_e, nvme_d + nvme_e
    busy = compute + overhead
    if cpu:  # A5: CPU experts run beside the GPU's resident experts; only the excess adds
        busy += max(0.0, cpu - expert_compute)
    ahead = recall * link_expert + (link_dense if prefetch_dense else 0.0)
    crossing = sum(n for _, n, _, _, _ in layers) + cpu_disk_misses  # expert misses that cross a link
    read = link_expert / crossing if crossing else 0.0  # A4: one demand read's time on the link
    waits = sum(g * layer_wait((1 - recall) * n / g, u / g, read, c, hist, 1 - recall)
                for g, n, u, c, hist in layers)
    # A5: disk reads of experts computed on the CPU overlap the CPU's work on the others
    waits += max(0.0, (1 - recall) * cpu_disk_misses * read - overlappable)
    seconds = max(busy + waits + (0.0 if prefetch_dense else link_dense), max(pcie, nvme), ahead)
    stall = seconds - busy
    parts = {"compute": compute, "overhead": overhead, "CPU experts": cpu, "PCIe": pcie, "NVMe": nvme}
    return StepCost(seconds=seconds, compute_s=compute, overhead_s=overhead, cpu_s=cpu, pcie_s=pcie, nvme_s=nvme,
                    stall_s=max(stall, 0.0), bytes_h2d=h2d["dense"] + h2d["expert"],
                    bytes_disk=disk["dense"] + disk["expert"], bottleneck=_bottleneck(parts, m))


def layer_wait(mean_misses: float, uses: float, read_s: float, per_use_s: float,
               hist: Sequence[float] | None = None, demand_share: float = 1.0) -> float:
    """A4: expected seconds one layer waits for its demand reads: n of its `uses` experts missing, read one
    after another (read_s each) while it computes the others (per_use_s each, resident first, then each arrival
    as it lands: the last arrival, or the first when too little resident work covers it, sets the end).
    n ~ Poisson(mean_misses), at most all of them; or, given `hist` (P(n) from a routing trace), as the trace
    has it, a share `demand_share` of those reads being demand reads (the rest prefetched)."""
    def wait(n: float) -> float:
        return max(0.0, n * read_s - max(uses - 1.0, 0.0) * per_use_s, read_s - max(uses - n, 0.0) * per_use_s)

    if hist is not None:
        return sum(p * wait(n * demand_share) for n, p in enumerate(hist) if n)
    if mean_misses <= 0 or read_s <= 0 or uses <= 0:
        return 0.0
    top = max(1, math.ceil(uses))
    pmf, total, mass = math.exp(-mean_misses), 0.0, 0.0
    for n in range(top + 1):
        p = pmf if n < top else max(0.0, 1.0 - mass)  # the tail beyond `top` misses counts as all missing
        if n:
            total += p * wait(min(n, uses))
        mass += pmf
        pmf *= mean_misses / (n + 1)
    return total


def _bottleneck(parts: dict[str, float], m: Machine) -> str:
    name = max(parts, key=lambda k: parts[k])
    if name == "compute":
        return "compute (GPU memory bandwidth)" if m.compute == "gpu" else "RAM bandwidth (CPU compute)"
    if name == "CPU experts":
        return "RAM bandwidth (CPU experts)"
    if name == "PCIe" and m.compute == "cpu":
        return "RAM bandwidth (copies to the compute pool)"
    if name == "overhead":
        return "per-op overhead (kernel launches / Python)"
    return name


# ---- routing traces ----------------------------------------------------------------------------------------
def _trace_tokens(trace) -> list[list[list[int]]]:
    """Experts per token and MoE layer: [[[expert, ...] per MoE layer] per token]. Accepts that list, {"tokens":
    that list}, or tools/trace_experts.py's record ({"moe_layers": [...], "steps": [[layer, [[expert, ...] per
    token of the forward]], ...]}, one step per forward and MoE layer, layers in order)."""
    if isinstance(trace, dict) and isinstance(trace.get("steps"), list):
        steps = trace["steps"]
        layers = trace.get("moe_layers") or sorted({step[0] for step in steps})
        index = {layer: i for i, layer in enumerate(layers)}
        tokens: list[list[list[int]]] = []
        base = 0
        for layer, per_token in steps:
            if index[layer] == 0:  # the first MoE layer: a new forward begins
                base = len(tokens)
                tokens.extend([[] for _ in layers] for _ in per_token)
            for j, experts in enumerate(per_token):
                tokens[base + j][index[layer]] = [int(e) for e in experts]
        trace = tokens
    tokens = trace.get("tokens") if isinstance(trace, dict) else trace
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, list) for t in tokens):
        raise ValueError("a routing trace is {\"tokens\": [[[expert, ...] per MoE layer] per token]} or "
                         "tools/trace_experts.py's record")
    return tokens


def _replay(trace, device_share: int, host_share: int) -> Iterator[tuple[int, int, int]]:
    """(uses, device hits, host hits including device) per token and MoE layer of the trace, through a
    per-layer LRU with `device_share` / `host_share` slots per layer (the layer-lru partition; the host cache is
    inclusive: every read passes through it)."""
    from collections import OrderedDict

    caches: dict[int, tuple[OrderedDict, OrderedDict]] = {}
    for token in _trace_tokens(trace):
        for layer, experts in enumerate(token):
            dev, host = caches.setdefault(layer, (OrderedDict(), OrderedDict()))
            dev_hits = host_hits = 0
            for e in experts:
                dev_hits += e in dev
                host_hits += e in dev or e in host
                for cache, cap in ((dev, device_share), (host, host_share)):
                    if cap <= 0:
                        continue
                    cache[e] = True
                    cache.move_to_end(e)
                    while len(cache) > cap:
                        cache.popitem(last=False)
            yield len(experts), dev_hits, host_hits


def simulate_trace(trace, device_share: int, host_share: int) -> tuple[float, float]:
    """(p_device, p_host including device) of the trace replayed through the per-layer caches."""
    uses = dev_hits = host_hits = 0
    for u, d, h in _replay(trace, device_share, host_share):
        uses, dev_hits, host_hits = uses + u, dev_hits + d, host_hits + h
    return (dev_hits / uses, host_hits / uses) if uses else (0.0, 0.0)


def trace_miss_histogram(trace, device_share: int) -> tuple[float, ...]:
    """P(n): the share of the trace's (token, MoE layer) steps that miss n experts in the compute tier's
    per-layer cache (A4 with the trace's own burstiness: misses cluster on some layers and tokens)."""
    counts: dict[int, int] = {}
    for u, d, _ in _replay(trace, device_share, 0):
        counts[u - d] = counts.get(u - d, 0) + 1
    total = sum(counts.values())
    return tuple(counts.get(n, 0) / total for n in range(max(counts) + 1)) if total else (1.0,)


def trace_union(trace, max_tokens: int) -> list[float]:
    """Mean distinct experts per layer over windows of 1..max_tokens consecutive tokens."""
    tokens = _trace_tokens(trace)
    out = []
    for w in range(1, max_tokens + 1):
        sizes = [len({e for tok in tokens[t:t + w] for e in tok[layer]})
                 for t in range(0, len(tokens) - w + 1, w) for layer in range(len(tokens[t]))]
        out.append(sum(sizes) / len(sizes) if sizes else 0.0)
    return out
