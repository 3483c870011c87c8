"""plan(spec, budget, profile) -> Plan: the placement the store will execute, the memory per tier, and the
predicted decode speed. Pure: no weights are read, sizes come from config.json through the architecture's
schema (or, for architectures the runtime does not implement yet, a planning-only schema).

A Plan holds the Placement (from `placement.place`, the function Engine.open places with, for the same budgets
and KV bytes), a memory table per tier, three decode predictions (no expert-cache hits / expected / all hits)
from `costs.step_cost`, and, with speculation, the same per verify step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..checkpoint.arch import get_naming, supported_model_types
from ..checkpoint.gguf.config import build_config, file_format
from ..checkpoint.gguf.reader import is_gguf, read_gguf
from ..checkpoint.hf_config import ModelSpec, parse_config
from ..checkpoint.naming import ModelSchema, UnitKey
from ..constants import DEFAULT_CONTEXT, PREFILL_CHUNK
from ..errors import ConfigError
from . import costs, kv
from .formats import WHAT_IF_CONFIGS, WeightFormat, unit_bytes
from .hardware import HardwareProfile
from .placement import Placement, place
from .planning_only import vision_params
from .sizes import param_counts

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
# Charged in the memory table, outside the engine's ledger (--vram / --ram budget the store's slots, staging and
# KV cache only): a fixed CUDA context figure (context + cuBLAS workspace + caching-allocator slack; a bare CUDA
# context alone is 0.3-0.5 GiB on recent drivers), the host process, and the activations (activation_bytes)
DEVICE_RESERVE = int(0.75 * 2**30)
HOST_RESERVE = 2 * 2**30  # OS, Python, torch libraries


def gguf_model_spec(path: Path) -> ModelSpec:
    """A GGUF file's config (checkpoint/gguf/config.py), sized as its file type's nearest format."""
    g = read_gguf(path)
    cfg = build_config(g)
    cfg["dtype"], what_if = file_format(g)
    if what_if is not None:
        cfg["quantization_config"] = {"quant_method": "mxfp4"} if what_if == "mxfp4" else WHAT_IF_CONFIGS[what_if]
    return parse_config(cfg, path)


# ---- the model, from config.json alone ---------------------------------------------------------------------
def resolve_model(name_or_dir: str) -> Path:
    """A folder with config.json, a JSON file, or NAME of configs/models/NAME.json (case-insensitive)."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file():
        return path
    wanted = str(name_or_dir).lower().removesuffix(".json")
    for p in sorted(MODELS_DIR.glob("*.json")):
        if p.stem.lower() == wanted:
            return p
    names = ", ".join(p.stem for p in sorted(MODELS_DIR.glob("*.json")))
    raise ConfigError(f"--model {name_or_dir!r}: not a folder with config.json, not a file, and not a model "
                      f"config name; names: {names}")


def load_model_spec(name_or_dir: str) -> ModelSpec:
    path = resolve_model(name_or_dir)
    if is_gguf(path):
        return gguf_model_spec(path)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a model config must be a JSON object")
    return parse_config(cfg, path)  # flattens a vision-language release's text_config (Qwen3.5), as the engine


@dataclass
class ModelShape:
    """Units and their tensors, from config alone; `mtp` holds the multi-token-prediction units."""

    spec: ModelSpec
    schema: ModelSchema
    mtp: ModelSchema
    source: str  # "runtime" (the engine's own schema) or "planning-only"
    extra_params: dict[str, int] = field(default_factory=dict)  # e.g. a vision tower the text engine skips
    mtp_shared_params: int = 0  # embedding/head copies a checkpoint stores for MTP (shared with the trunk)
    one_call: bool = False  # a resident CPU step may take all layers in one native call (costs.ONE_CALL_ARCHS)
    cache: dict = field(default_factory=dict, repr=False)  # derived figures, computed once per shape

    @property
    def moe_layers(self) -> list[int]:
        if "moe_layers" not in self.cache:
            self.cache["moe_layers"] = sorted({k.layer for k in self.schema.keys("expert")})
        return self.cache["moe_layers"]

    @property
    def experts_per_layer(self) -> int:
        layers = self.moe_layers
        return sum(1 for k in self.schema.keys("expert") if k.layer == layers[0]) if layers else 0

    def params(self):
        if "params" not in self.cache:
            self.cache["params"] = param_counts(self.schema, self.spec.num_experts_per_tok)
        return self.cache["params"]

    def bytes_of(self, fmt: "WeightFormat", with_mtp: bool, kernel_itemsize: int = 0) -> dict[UnitKey, int]:
        """Bytes of every unit under `fmt` (the MTP units too when `with_mtp`); with `kernel_itemsize`, what each
        unit's slot holds on a CPU: the unit and its kernel forms' room (planner/kernel_room.py)."""
        key = ("bytes", fmt, with_mtp, kernel_itemsize)
        if key not in self.cache:
            units = {k: unit_bytes(k, v, fmt, kernel_itemsize) for k, v in self.schema.units.items()}
            if with_mtp:
                units.update({k: unit_bytes(k, v, fmt, kernel_itemsize) for k, v in self.mtp.units.items()})
            self.cache[key] = units
        return self.cache[key]

    def mean_unit(self, kind: str, units: Mapping[UnitKey, int], mtp: bool = False) -> tuple[float, float]:
        """(mean bytes, mean parameters) of the kind's units (of the first MoE layer for experts)."""
        schema = self.mtp if mtp else self.schema
        key = ("mean", kind, mtp, id(units))
        if key not in self.cache:
            first = min((x.layer for x in schema.keys("expert")), default=None)
            keys = [k for k in schema.keys(kind) if kind != "expert" or k.layer == first]
            self.cache[key] = ((sum(units[k] for k in keys) / len(keys), sum(schema.unit_numel(k) for k in keys)
                                / len(keys)) if keys else (0.0, 0.0))
        return self.cache[key]

    def layer_types(self) -> list[str]:
        return kv.layer_types(self.spec)

    def kv_bytes(self, positions: int, itemsize: int, with_mtp: bool = False, kv_dtype: str = "auto") -> int:
        """KV cache for `positions` stored as `kv_dtype` (plus the fixed recurrent state of linear-attention
        layers)."""
        mtp_layers = len({k.layer for k in self.mtp.keys()}) if with_mtp else 0
        return kv.kv_bytes(self.spec, positions, itemsize, mtp_layers=mtp_layers, kv_dtype=kv_dtype)


def model_shape(spec: ModelSpec) -> ModelShape:

    if spec.model_type in supported_model_types():
        arch = get_naming(spec.model_type, spec.path or "config.json")
        args = arch.args(spec)
        mtp = arch.mtp_schema(args) if hasattr(arch, "mtp_schema") else ModelSchema()
        routed_only = getattr(args, "routed_only", None)  # DecoderArgs' (the standard decoder's)
        shape = ModelShape(spec, arch.schema(args), mtp, "runtime", one_call=(
            arch.name in costs.ONE_CALL_ARCHS and routed_only is not None and routed_only()))
        if mtp.units and spec.get("num_nextn_predict_layers"):
            # DeepSeek-style releases store embed_tokens / shared_head.head copies in each MTP layer: counted as
            # parameters (DeepSeek-V3's 685 B = 671 B + 14 B), not placed (the trunk's are shared)
            shape.mtp_shared_params = 2 * spec.get("num_nextn_predict_layers") * spec.vocab_size * spec.hidden_size
    else:
        raise ConfigError(f"{spec.path}: unsupported model_type {spec.model_type!r}; supported: "
                          f"{', '.join(supported_model_types())}")
    vision = spec.get("vision_config")
    if isinstance(vision, dict) and vision.get("depth"):
        shape.extra_params["vision"] = vision_params(vision)
    return shape


# ---- the plan ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanOptions:
    vram: int | None = None  # bytes; None: the profile's VRAM less the reserve (GPU profiles)
    ram: int | None = None  # bytes; None: the profile's RAM less the reserve
    context: int = DEFAULT_CONTEXT
    weights: str | None = None  # None: the checkpoint's own format
    expert_weights: str | None = None  # routed experts only (the "int4 experts" what-if)
    spec: str = "off"  # off | auto | mtp | ngram
    recall: float = costs.DEFAULT_RECALL
    alpha: float = costs.DEFAULT_ALPHA
    host_compute: bool = False
    position: int | None = None  # tokens already in the cache at the predicted step; None: context // 2
    trace: Any = None  # routing trace (see costs.simulate_trace)
    stats: Mapping[str, float] | None = None  # measured {"expert_hit_rate" | "hit_rate": x} replaces locality
    direct_io: str = "auto"
    accept: float | None = None  # per-position draft acceptance
    drafts: int | None = None
    overhead_scale: float = 1.0  # multiplies dispatch and bookkeeping costs; 0: the bound the hardware sets
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per forward (run --prefill-chunk)
    kv_dtype: str = "auto"  # the KV cache's storage (run --kv-dtype; planner/kv.py charges its real size)
    cache_ram: int | str = 0  # saved prompt prefixes (serve --cache-ram: a size or "auto"), charged to the host tier


@dataclass
class Plan:
    shape: ModelShape
    profile: HardwareProfile
    options: PlanOptions
    fmt: WeightFormat
    placement: Placement
    unit_bytes: dict[UnitKey, int]
    kv_bytes: int
    activations: dict[str, int]
    reserve: dict[str, int]
    separate_host: bool
    direct_io: bool
    use_mtp: bool
    hits: dict[str, dict[str, tuple[float, float]]]  # scenario -> kind -> (p_device, p_host)
    steps: dict[str, costs.StepCost]  # scenario -> one step
    tok_s: dict[str, float]
    spec_info: dict[str, Any] | None
    warnings: list[str]
    params: Any  # sizes.ParamCounts of the main model
    fit: dict[str, tuple[int, int]] = field(default_factory=dict)  # "VRAM" / "RAM" -> (charged bytes, physical)

    @property
    def kv_bytes_per_position(self) -> int:
        """The main model's attention entries for one position, as --kv-dtype stores them."""
        return kv.kv_bytes_per_position(self.shape.spec, self.kv_itemsize, self.options.kv_dtype)

    @property
    def kv_itemsize(self) -> int:
        return kv_itemsize(self.profile, self.shape.spec)

    @property
    def bytes_total(self) -> int:
        return sum(n for k, n in self.unit_bytes.items() if k in self.shape.schema.units)

    @property
    def expected(self) -> float:
        return self.tok_s["expected"]


SPEC_DEFAULTS = {"mtp": (1, 0.85), "ngram": (3, 0.35)}  # (drafts, per-position acceptance): FIELD-NOTES / stated


def kv_itemsize(profile: HardwareProfile, spec: ModelSpec) -> int:
    """The compute dtype's bytes: the engine computes in bf16 on CUDA, and on a CPU for a bf16 checkpoint
    (runtime/devices.py resolve_dtype; the profile's CPU is taken to multiply bf16 natively, as server CPUs since 2020 do),
    else in fp32."""
    return 2 if profile.has_gpu or spec.dtype == "bfloat16" else 4


def plan(model: ModelSpec | ModelShape, profile: HardwareProfile, options: PlanOptions = PlanOptions()) -> Plan:
    shape = model if isinstance(model, ModelShape) else model_shape(model)
    spec, o, warnings = shape.spec, options, []
    fmt = WeightFormat.of(spec, o.weights, o.expert_weights)
    if o.spec not in ("off", "auto", "mtp", "ngram"):
        raise ConfigError(f"--spec {o.spec!r}: choose off, auto, mtp or ngram")
    if o.spec == "mtp" and not shape.mtp.units:
        raise ConfigError(f"--spec mtp: {spec.path} has no multi-token-prediction layers")
    use_mtp = bool(shape.mtp.units) and o.spec in ("mtp", "auto")
    units = shape.bytes_of(fmt, use_mtp)
    separate_host = profile.has_gpu or o.vram is not None
    itemsize = kv_itemsize(profile, spec)
    kv_charge = shape.kv_bytes(o.context, itemsize, with_mtp=use_mtp, kv_dtype=o.kv_dtype)
    act = activation_bytes(shape, o.context, itemsize, o.prefill_chunk, o.kv_dtype)
    reserve = {"device": DEVICE_RESERVE if profile.has_gpu else 0, "host": HOST_RESERVE}
    activations = {"device" if profile.has_gpu else "host": act}  # on a CPU the compute pool's work is in RAM
    vram, ram = o.vram, o.ram
    if vram is None and profile.has_gpu:
        vram = max(profile.vram_bytes - reserve["device"] - act, 0)
    if ram is None:
        ram = max(profile.ram_bytes - reserve["host"] - (0 if profile.has_gpu else act + (vram or 0)), 0)
    # a CPU's slots also hold their units' kernel forms (what the engine's slots are sized with); reads move `units`
    slots = units if profile.has_gpu else shape.bytes_of(fmt, use_mtp, itemsize)
    placement, direct = place(slots, device_budget=vram, host_budget=ram, kv_bytes=kv_charge,
                              direct_io=o.direct_io, gpu=profile.has_gpu,
                              prompt_cache_bytes=kv.prompt_cache_bytes(o.cache_ram, ram, sum(units.values())))
    sizes = placement.sizes
    fit = physical_fit(placement, activations, reserve, profile)
    for memory, (need, have) in fit.items():
        if need > have:
            flag = "--vram" if memory == "VRAM" else "--ram"
            tier = placement.compute if memory == "VRAM" else placement.tiers[-1]
            largest = have - (need - tier.used(sizes))  # the physical memory less what is charged besides
            warnings.append(f"{memory}: the budgets + activations + reserve = {_gib(need)} exceed the {_gib(have)} "
                            f"of {profile.name}; the largest {flag} that fits is {_gib(max(largest, 0))}")
    # experts of a per-expert checkpoint are one range each (O_DIRECT straight into the slot); fused ones bounce
    fused_experts = any(t.index is not None for k in shape.schema.keys("expert")
                        for t in shape.schema.units[k].values())
    hits, steps, tok_s = {}, {}, {}
    drafts, accept, info = _spec_setup(shape, o, use_mtp)
    m = 1 + drafts
    for scenario in ("no_hits", "expected", "all_hits"):
        hits[scenario] = hit_rates(shape, placement, scenario, o)
        flows = step_flows(shape, placement, units, hits[scenario], m, drafts if use_mtp else 0, o)
        position = o.position if o.position is not None else o.context // 2
        steps[scenario] = costs.step_cost(
            flows, costs.Machine.of(profile, separate_host, native_experts=itemsize == 2 and fmt.expert is None,
                                    one_call=itemsize == 2 and not placement.streams and shape.one_call),
            recall=o.recall,
            host_compute=o.host_compute and profile.has_gpu,
            kv_read_bytes=kv.kv_read_bytes(spec, position, itemsize, o.kv_dtype),
            overhead_scale=o.overhead_scale, bounce_gbps=profile.ram_gbps if direct else None,
            bounced=("dense", "expert") if fused_experts else ("dense",))
        tok_s[scenario] = costs.accepted_per_step(drafts, accept) / steps[scenario].seconds
    if info is not None:
        info.update(accepted_per_step=costs.accepted_per_step(drafts, accept), drafts=drafts, accept=accept)
    if o.host_compute and not profile.has_gpu:
        warnings.append("--host-compute has no effect without a GPU: every unit is computed on the CPU already")
    return Plan(shape, profile, o, fmt, placement, units, kv_charge, activations, reserve, separate_host, direct,
                use_mtp, hits, steps, tok_s, info, warnings, shape.params(), fit)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def physical_fit(placement: Placement, activations: Mapping[str, int], reserve: Mapping[str, int],
                 profile: HardwareProfile) -> dict[str, tuple[int, int]]:
    """(bytes charged, physical bytes) per memory: every tier's budgeted use (slots, staging, KV) plus the
    activations and reserves outside the budgets. On a CPU every tier, the compute pool included, is RAM."""
    used = {t.name: t.used(placement.sizes) for t in placement.tiers}
    if not profile.has_gpu:
        return {"RAM": (sum(used.values()) + sum(activations.values()) + reserve["host"], profile.ram_bytes)}
    return {"VRAM": (used["device"] + activations.get("device", 0) + reserve["device"], profile.vram_bytes),
            "RAM": (used["host"] + activations.get("host", 0) + reserve["host"], profile.ram_bytes)}


def activation_bytes(shape: ModelShape, context: int, itemsize: int, chunk: int = PREFILL_CHUNK,
                     kv_dtype: str = "auto") -> int:
    """Largest transient working set: a prompt chunk of min(context, chunk) tokens attending to a full
    context (CausalLM.forward runs longer prompts a chunk at a time), with the logits of every position, P x
    vocab x 4 bytes, as Engine.logits returns them (generation's prefill keeps the last row only); or one
    decode step at a full context (GQA K/V expanded to all heads). A cache not stored in the compute dtype adds
    the layer's dequantized copy (kv.kv_copy_bytes)."""
    s = shape.spec
    inter = max(s.intermediate_size, s.get("moe_intermediate_size") or 0)
    heads, D = s.num_heads, s.head_dim

    def working(p: int, ctx: int) -> int:
        return (p * s.hidden_size * itemsize * 8 + p * inter * itemsize * 3 + 2 * ctx * heads * D * itemsize
                + heads * p * ctx * 4 + p * s.vocab_size * 4)

    return (max(working(min(context, chunk), context), working(1, context))
            + kv.kv_copy_bytes(s, context, itemsize, kv_dtype))


def _spec_setup(shape: ModelShape, o: PlanOptions, use_mtp: bool) -> tuple[int, float, dict | None]:
    if o.spec == "off":
        return 0, 0.0, None
    method = "mtp" if use_mtp else "ngram"
    drafts, accept = SPEC_DEFAULTS[method]
    if use_mtp:
        drafts = len({k.layer for k in shape.mtp.keys()})
    drafts, accept = o.drafts or drafts, o.accept if o.accept is not None else accept
    N, k = shape.experts_per_layer, shape.spec.num_experts_per_tok
    union = [round(costs.expert_union(N, k, t), 2) for t in range(1, drafts + 2)]
    if o.trace is not None:
        union = [round(u, 2) for u in costs.trace_union(o.trace, drafts + 1)]
    return drafts, accept, {"method": method, "tokens_per_step": drafts + 1, "expert_union_per_layer": union}


def hit_rates(shape: ModelShape, placement: Placement, scenario: str,
              o: PlanOptions) -> dict[str, tuple[float, float]]:
    """(p_device, p_host) per kind: where a use of the kind finds its unit (A6)."""
    out = {}
    tiers = placement.tiers
    host = tiers[1] if len(tiers) > 1 else None
    for kind, size in placement.sizes.items():
        if kind in placement.compute.pinned or scenario == "all_hits" or size.count == 1:
            out[kind] = (1.0, 0.0)
            continue
        dev_slots = placement.compute.slots.get(kind, 0)
        host_pinned = host is not None and kind in host.pinned
        host_slots = host.slots.get(kind, 0) if host is not None else 0
        if kind != "expert":
            p_dev = costs.scan_hit_fraction(dev_slots, size.count)
            p_host_all = 1.0 if host_pinned else costs.scan_hit_fraction(host_slots, size.count)
        elif scenario == "no_hits":
            p_dev, p_host_all = 0.0, 1.0 if host_pinned else 0.0
        else:
            p_dev, p_host_all = _expert_hits(shape, dev_slots, host_slots, size.count, o)
            p_host_all = 1.0 if host_pinned else p_host_all
        out[kind] = (p_dev, max(p_host_all - p_dev, 0.0) if host is not None else 0.0)
    return out


def _expert_hits(shape: ModelShape, dev_slots: int, host_slots: int, count: int, o: PlanOptions) -> tuple[float, float]:
    if o.stats:
        measured = o.stats.get("expert_hit_rate", o.stats.get("hit_rate"))
        host = o.stats.get("host_hit_rate")
        if measured is not None:
            return float(measured), float(host) if host is not None else costs.hit_fraction(host_slots / count, o.alpha)
    if o.trace is not None:
        layers = max(len(shape.moe_layers), 1)
        return costs.simulate_trace(o.trace, dev_slots // layers, host_slots // layers)
    return costs.hit_fraction(dev_slots / count, o.alpha), costs.hit_fraction(host_slots / count, o.alpha)


def step_flows(shape: ModelShape, placement: Placement, units: Mapping[UnitKey, int],
               hits: Mapping[str, tuple[float, float]], tokens: int, mtp_drafts: int,
               o: PlanOptions) -> list[costs.Flow]:
    """What one step computes: embed, every layer's dense unit, the union of routed experts over `tokens`,
    the head; with MTP drafting, the MTP module and its experts once per draft."""
    s = shape.spec
    k, N = s.num_experts_per_tok, shape.experts_per_layer
    flows = []
    for kind, uses in (("embed", 1), ("dense", s.num_layers), ("head", 1 + mtp_drafts)):
        if kind in placement.sizes:
            b, p = shape.mean_unit(kind, units)
            row = b * tokens / s.vocab_size if kind == "embed" else None  # a lookup reads one row per token
            if placement.by_rows(kind):  # read by rows from the checkpoint (store.rows): those bytes, every step
                flows.append(costs.Flow(kind, uses, row, 0.0, tokens, 0.0, 0.0, compute_bytes=row))
                continue
            flows.append(costs.Flow(kind, uses, b, p if kind != "embed" else 0.0, tokens, *hits[kind],
                                    compute_bytes=row))
    moe = shape.moe_layers
    if moe:
        union = (costs.trace_union(o.trace, tokens)[-1] if o.trace is not None and tokens > 1
                 else costs.expert_union(N, k, tokens))
        b, p = shape.mean_unit("expert", units)
        p_dev = hits["expert"][0]
        # decode with a trace: the trace's own misses per layer and token (A4), at the compute tier's share
        hist = (costs.trace_miss_histogram(o.trace, placement.compute.slots.get("expert", 0) // len(moe))
                if o.trace is not None and not o.stats and tokens == 1 and 0.0 < p_dev < 1.0 else None)
        flows.append(costs.Flow("expert", len(moe) * union, b, p, tokens * k / union, *hits["expert"],
                                groups=len(moe), miss_hist=hist))
    if mtp_drafts:
        b, p = shape.mean_unit("mtp", units, mtp=True)
        flows.append(costs.Flow("mtp", mtp_drafts, b, p, 1, *hits["mtp"]))
        if any(True for _ in shape.mtp.keys("expert")):
            b, p = shape.mean_unit("expert", units, mtp=True)
            flows.append(costs.Flow("expert", mtp_drafts * k, b, p, 1, *hits["expert"], groups=mtp_drafts))
    return flows
