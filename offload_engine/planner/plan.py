"""plan(spec, budget, profile) -> Plan: the placement the store will execute, the memory per tier, and the
predicted decode speed. Pure: no weights are read, sizes come from config.json through the architecture's
schema (or, for architectures the runtime does not implement yet, a planning-only schema below).

A Plan holds the Placement (exactly what `store.build.plan_for` would compute for the same budgets and
context), a memory table per tier, three decode predictions (no expert-cache hits / expected / all hits)
from `costs.step_cost`, and, with speculation, the same per verify step.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..checkpoint.hf_config import ModelSpec, parse_config
from ..checkpoint.naming import ModelSchema, TensorSpec, UnitKey
from ..errors import ConfigError
from . import costs
from .hardware import HardwareProfile
from .placement import Placement, kind_sizes, plan_placement
from .sizes import param_counts

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
# bits per weight of each --weights format, scales included: fp8 with 128x128 fp32 block scales (DeepSeek-V3
# style); int8 and int4 as llama.cpp's Q8_0 / Q4_0 (32-weight blocks with an fp16 scale: 8.5 and 4.5 bits)
FORMAT_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0 + 32 / (128 * 128), "int8": 8.5, "int4": 4.5}
DTYPE_BITS = {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0}
QUANT_BITS = {"fp8": FORMAT_BITS["fp8"], "mxfp4": 4.25}  # released checkpoints' quantization_config
PLANNING_ONLY = ("gpt_oss",)
# Charged in the memory table, outside the engine's ledger (--vram / --ram budget the store's slots, staging and
# KV cache only): a fixed CUDA context figure (context + cuBLAS workspace + caching-allocator slack; a bare CUDA
# context alone is 0.3-0.5 GiB on recent drivers), the host process, and the activations (activation_bytes)
DEVICE_RESERVE = int(0.75 * 2**30)
HOST_RESERVE = 2 * 2**30  # OS, Python, torch libraries
PREFILL_CHUNK = 512  # default prompt tokens per forward (runtime/model.py); activation_bytes sizes for it


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

    def bytes_of(self, fmt: "WeightFormat", with_mtp: bool) -> dict[UnitKey, int]:
        """Bytes of every unit under `fmt` (the MTP units too when `with_mtp`)."""
        key = ("bytes", fmt, with_mtp)
        if key not in self.cache:
            units = {k: unit_bytes(k, v, fmt) for k, v in self.schema.units.items()}
            if with_mtp:
                units.update({k: unit_bytes(k, v, fmt) for k, v in self.mtp.units.items()})
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
        s = self.spec
        types = s.get("layer_types")
        if isinstance(types, list) and len(types) == s.num_layers:
            return [str(t) for t in types]
        if s.model_type in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"):
            interval = s.get("full_attention_interval") or 4
            return ["full_attention" if (l + 1) % interval == 0 else "linear_attention" for l in range(s.num_layers)]
        return ["full_attention"] * s.num_layers

    def kv_bytes(self, positions: int, itemsize: int, with_mtp: bool = False) -> int:
        """KV cache for `positions` (plus the fixed recurrent state of linear-attention layers)."""
        s, types = self.spec, self.layer_types()
        if s.get("kv_lora_rank"):  # MLA: one latent and one rope key per layer
            per_layer = (s.get("kv_lora_rank") + s.get("qk_rope_head_dim")) * itemsize * positions
            return per_layer * (s.num_layers + (len({k.layer for k in self.mtp.keys()}) if with_mtp else 0))
        kv = 2 * s.num_kv_heads * s.head_dim * itemsize
        window = s.get("sliding_window") or positions
        total = 0
        for t in types:
            if t == "full_attention":
                total += kv * positions
            elif t == "sliding_attention":
                total += kv * min(positions, window)
            else:  # linear attention: conv state + fp32 recurrent state, independent of the context
                nk, nv = s.get("linear_num_key_heads", 16), s.get("linear_num_value_heads", 32)
                dk, dv = s.get("linear_key_head_dim", 128), s.get("linear_value_head_dim", 128)
                conv = (2 * nk * dk + nv * dv) * (s.get("linear_conv_kernel_dim", 4) - 1) * itemsize
                total += conv + nv * dk * dv * 4
        if with_mtp:
            total += kv * positions * len({k.layer for k in self.mtp.keys()})
        return total


def model_shape(spec: ModelSpec) -> ModelShape:
    from ..runtime.arch import get_architecture, supported_model_types

    if spec.model_type in supported_model_types():
        arch = get_architecture(spec.model_type, spec.path or "config.json")
        args = arch.args(spec)
        mtp = arch.mtp_schema(args) if hasattr(arch, "mtp_schema") else ModelSchema()
        shape = ModelShape(spec, arch.schema(args), mtp, "runtime")
        if mtp.units and spec.get("num_nextn_predict_layers"):
            # DeepSeek-style releases store embed_tokens / shared_head.head copies in each MTP layer: counted as
            # parameters (DeepSeek-V3's 685 B = 671 B + 14 B), not placed (the trunk's are shared)
            shape.mtp_shared_params = 2 * spec.get("num_nextn_predict_layers") * spec.vocab_size * spec.hidden_size
    elif spec.model_type == "gpt_oss":
        shape = _gpt_oss_shape(spec)
    else:
        raise ConfigError(f"{spec.path}: model_type {spec.model_type!r} has neither a runtime architecture nor a "
                          f"planning-only schema; planning-only: {', '.join(PLANNING_ONLY)}; runtime: "
                          f"{', '.join(supported_model_types())}")
    vision = spec.get("vision_config")
    if isinstance(vision, dict) and vision.get("depth"):
        shape.extra_params["vision"] = _vision_params(vision)
    return shape


# ---- planning-only schemas (sizes from config fields, for architectures the runtime does not run yet) -------
def _embed_head(schema: ModelSchema, s: ModelSpec, prefix: str) -> None:
    V, H = s.vocab_size, s.hidden_size
    schema.add(UnitKey(-1, "embed"), "weight", TensorSpec(f"{prefix}embed_tokens.weight", (V, H)))
    head = UnitKey(s.num_layers, "head")
    schema.add(head, "norm", TensorSpec(f"{prefix}norm.weight", (H,)))
    schema.add(head, "weight", TensorSpec("lm_head.weight" if not s.tie_word_embeddings
                                          else f"{prefix}embed_tokens.weight", (V, H)))


def _vision_params(v: Mapping[str, Any]) -> int:
    """Qwen3.5's ViT: patch embed, position embedding, `depth` blocks, patch merger (text-only engine skips it)."""
    h, i, depth = v.get("hidden_size", 0), v.get("intermediate_size", 0), v.get("depth", 0)
    merge, out = v.get("spatial_merge_size", 2), v.get("out_hidden_size", 0)
    block = (3 * h * h + 3 * h) + (h * h + h) + (i * h + i) + (h * i + h) + 4 * h
    patch = v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * v.get("patch_size", 16) ** 2 * h + h
    m = h * merge * merge
    merger = 2 * h + (m * m + m) + (out * m + out)
    return depth * block + patch + v.get("num_position_embeddings", 0) * h + merger


def _gpt_oss_shape(s: ModelSpec) -> ModelShape:
    """gpt-oss: biased GQA attention with sinks, a biased router, fused experts [E, ...] with biases."""
    schema = ModelSchema()
    H, D, E, inter = s.hidden_size, s.head_dim, s.num_experts, s.intermediate_size
    _embed_head(schema, s, "model.")
    for l in range(s.num_layers):
        key, p = UnitKey(l, "dense"), f"model.layers.{l}."
        q, kv = s.num_heads * D, s.num_kv_heads * D
        for local, shp in (("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,)),
                           ("self_attn.q_proj.weight", (q, H)), ("self_attn.q_proj.bias", (q,)),
                           ("self_attn.k_proj.weight", (kv, H)), ("self_attn.k_proj.bias", (kv,)),
                           ("self_attn.v_proj.weight", (kv, H)), ("self_attn.v_proj.bias", (kv,)),
                           ("self_attn.o_proj.weight", (H, q)), ("self_attn.o_proj.bias", (H,)),
                           ("self_attn.sinks", (s.num_heads,)), ("mlp.router.weight", (E, H)),
                           ("mlp.router.bias", (E,))):
            schema.add(key, local, TensorSpec(p + local, shp))
        x = f"{p}mlp.experts."
        for e in range(E):
            ek = UnitKey(l, "expert", e)
            schema.add(ek, "gate_up", TensorSpec(x + "gate_up_proj", (H, 2 * inter), index=e))
            schema.add(ek, "gate_up_bias", TensorSpec(x + "gate_up_proj_bias", (2 * inter,), index=e))
            schema.add(ek, "down", TensorSpec(x + "down_proj", (inter, H), index=e))
            schema.add(ek, "down_bias", TensorSpec(x + "down_proj_bias", (H,), index=e))
    return ModelShape(s, schema, ModelSchema(), "planning-only")


# ---- bytes under a weight format ---------------------------------------------------------------------------
SMALL_LOCALS = ("router", "shared_gate", "mlp.gate.weight", "mlp.router.weight")


@dataclass(frozen=True)
class WeightFormat:
    """Bits per weight by tensor class. 1-D tensors, routers and conv kernels stay 16-bit in every format."""

    name: str
    dense_bits: float  # attention, dense MLPs, shared experts, MTP projections
    expert_bits: float  # routed experts
    embed_bits: float  # embedding and output head
    small_bits: float = 16.0

    @classmethod
    def of(cls, spec: ModelSpec, weights: str | None, expert_weights: str | None = None) -> "WeightFormat":
        fmt = cls._of(spec, weights)
        if expert_weights:
            if expert_weights not in FORMAT_BITS:
                raise ConfigError(f"expert weights {expert_weights!r}: choose one of {', '.join(FORMAT_BITS)}")
            fmt = dataclasses.replace(fmt, name=f"{fmt.name}, {expert_weights} experts",
                                      expert_bits=FORMAT_BITS[expert_weights])
        return fmt

    @classmethod
    def _of(cls, spec: ModelSpec, weights: str | None) -> "WeightFormat":
        if weights:
            if weights not in FORMAT_BITS:
                raise ConfigError(f"--weights {weights!r}: choose one of {', '.join(FORMAT_BITS)}")
            bits = FORMAT_BITS[weights]
            return cls(weights, bits, bits, bits, 32.0 if weights == "fp32" else 16.0)
        quant = spec.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        has_dtype = any(spec.get(k) for k in ("dtype", "torch_dtype"))
        base = DTYPE_BITS.get(spec.dtype, 16.0) if has_dtype or not quant else 16.0
        if method == "fp8":  # DeepSeek-V3 / Kimi K2 releases: every layer matrix fp8, embed/head bf16
            return cls("fp8 (checkpoint)", QUANT_BITS["fp8"], QUANT_BITS["fp8"], base, base)
        if method == "mxfp4":  # gpt-oss: routed experts MXFP4, the rest bf16
            return cls("mxfp4 experts (checkpoint)", base, QUANT_BITS["mxfp4"], base, base)
        name = {32.0: "fp32", 16.0: "bf16" if spec.dtype == "bfloat16" else "fp16"}.get(base, spec.dtype)
        return cls(f"{name} (checkpoint)", base, base, base, base)

    def bits(self, kind: str, local: str, ts: TensorSpec) -> float:
        if len(ts.shape) < 2 or local in SMALL_LOCALS or "conv1d" in local:
            return self.small_bits
        if kind == "expert":
            return self.expert_bits
        return self.embed_bits if kind in ("embed", "head") else self.dense_bits


def unit_bytes(key: UnitKey, specs: Mapping[str, TensorSpec], fmt: WeightFormat) -> int:
    return sum(math.ceil(ts.numel * fmt.bits(key.kind, local, ts) / 8) for local, ts in specs.items())


# ---- the plan ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanOptions:
    vram: int | None = None  # bytes; None: the profile's VRAM less the reserve (GPU profiles)
    ram: int | None = None  # bytes; None: the profile's RAM less the reserve
    context: int = 4096
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
    def bytes_total(self) -> int:
        return sum(n for k, n in self.unit_bytes.items() if k in self.shape.schema.units)

    @property
    def expected(self) -> float:
        return self.tok_s["expected"]


SPEC_DEFAULTS = {"mtp": (1, 0.85), "ngram": (3, 0.35)}  # (drafts, per-position acceptance): FIELD-NOTES / stated


def plan(model: ModelSpec | ModelShape, profile: HardwareProfile, options: PlanOptions = PlanOptions()) -> Plan:
    from ..store.build import READER_THREADS, bounce_bytes
    from ..store.disk import DIRECT_SLACK

    shape = model if isinstance(model, ModelShape) else model_shape(model)
    spec, o, warnings = shape.spec, options, []
    fmt = WeightFormat.of(spec, o.weights, o.expert_weights)
    if o.spec not in ("off", "auto", "mtp", "ngram"):
        raise ConfigError(f"--spec {o.spec!r}: choose off, auto, mtp or ngram")
    if o.spec == "mtp" and not shape.mtp.units:
        raise ConfigError(f"--spec mtp: {spec.path} has no multi-token-prediction layers")
    use_mtp = bool(shape.mtp.units) and o.spec in ("mtp", "auto")
    units = shape.bytes_of(fmt, use_mtp)
    sizes = kind_sizes(units)
    separate_host = profile.has_gpu or o.vram is not None
    itemsize = 2 if profile.has_gpu else 4  # the engine computes in bf16 on CUDA, fp32 on CPU
    kv = shape.kv_bytes(o.context, itemsize, with_mtp=use_mtp)
    act = activation_bytes(shape, o.context, itemsize, o.prefill_chunk)
    reserve = {"device": DEVICE_RESERVE if profile.has_gpu else 0, "host": HOST_RESERVE}
    activations = {"device" if profile.has_gpu else "host": act}  # on a CPU the compute pool's work is in RAM
    vram, ram = o.vram, o.ram
    if vram is None and profile.has_gpu:
        vram = max(profile.vram_bytes - reserve["device"] - act, 0)
    if ram is None:
        ram = max(profile.ram_bytes - reserve["host"] - (0 if profile.has_gpu else act + (vram or 0)), 0)
    total = sum(units.values())
    direct = o.direct_io == "on" or (o.direct_io == "auto" and ram < total)
    if direct:  # slots that O_DIRECT reads land in straight carry page slack (store.build.plan_for)
        sizes = kind_sizes(units, DIRECT_SLACK)
    staging = READER_THREADS * bounce_bytes(sizes, ram) if direct else 0
    if separate_host:
        # CUDA reads stage through host slots (store._read_via_host): one per reader thread and kind
        placement = plan_placement(sizes, vram, ram, kv, staging, separate_host=True,
                                   host_staging=READER_THREADS if profile.has_gpu else 0)
    else:
        placement = plan_placement(sizes, ram, None, kv, staging, separate_host=False)
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
            flows, costs.Machine.of(profile, separate_host), recall=o.recall,
            host_compute=o.host_compute and profile.has_gpu, kv_read_bytes=shape.kv_bytes(position, itemsize),
            overhead_scale=o.overhead_scale, bounce_gbps=profile.ram_gbps if direct else None,
            bounced=("dense", "expert") if fused_experts else ("dense",))
        tok_s[scenario] = costs.accepted_per_step(drafts, accept) / steps[scenario].seconds
    if info is not None:
        info.update(accepted_per_step=costs.accepted_per_step(drafts, accept), drafts=drafts, accept=accept)
    if o.host_compute and not profile.has_gpu:
        warnings.append("--host-compute has no effect without a GPU: every unit is computed on the CPU already")
    return Plan(shape, profile, o, fmt, placement, units, kv, activations, reserve, separate_host, direct, use_mtp,
                hits, steps, tok_s, info, warnings, shape.params(), fit)


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


def activation_bytes(shape: ModelShape, context: int, itemsize: int, chunk: int = PREFILL_CHUNK) -> int:
    """Largest transient working set: a prompt chunk of min(context, chunk) tokens attending to a full
    context (CausalLM.forward runs longer prompts a chunk at a time), with the logits of every position, P x
    vocab x 4 bytes, as Engine.logits returns them (generation's prefill keeps the last row only); or one
    decode step at a full context (GQA K/V expanded to all heads)."""
    s = shape.spec
    inter = max(s.intermediate_size, s.get("moe_intermediate_size") or 0)
    heads, D = s.num_heads, s.head_dim

    def working(p: int, ctx: int) -> int:
        return (p * s.hidden_size * itemsize * 8 + p * inter * itemsize * 3 + 2 * ctx * heads * D * itemsize
                + heads * p * ctx * 4 + p * s.vocab_size * 4)

    return max(working(min(context, chunk), context), working(1, context))


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
