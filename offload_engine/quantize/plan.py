"""Which tensors `offload-engine quantize` quantizes and how, decided from the tensor headers and config.json alone.

Quantized: every 2-D floating `*.weight` of a linear layer (per expert for fused `[E, out, in]` expert tensors).
Kept as stored: embeddings, norms, biases, everything not 2-D, a vision tower, and by default the routers, the MTP
layers and the head (each its own flag), plus modules the user names (--keep REGEX). A group-quantized weight whose in_features
the group does not divide gets the largest group below it that does (at least MIN_GROUP), else it is kept: both
are reported, and each fitted group is its own compressed-tensors config group targeting those modules by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ..checkpoint.index import TensorRecord
from ..errors import ConfigError
from .scheme import WeightScheme

WEIGHTS = ("int8", "int4", "fp8")
DEFAULT_GROUP = {"int4": 32, "int8": 0, "fp8": 0}  # 0: one scale per output channel
CALIBRATION_TOKENS = 8192  # --calibrate's defaults: tokens of the text run through the model, in windows of
CALIBRATION_WINDOW = 512
MIN_GROUP = 8  # a fitted group smaller than this costs more in scales than it saves: keep the weight instead
FLOAT_SOURCES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_EMBED = re.compile(r"(^|\.)embed_tokens$|(^|\.)wte$|(^|\.)embeddings?$")
_HEAD = re.compile(r"(^|\.)lm_head$|(^|\.)shared_head\.head$")
_ROUTER = re.compile(r"(\.mlp\.gate|\.block_sparse_moe\.gate|\.shared_expert_gate|\.router)$")
_NORM = re.compile(r"norm", re.I)
_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class QuantizeOptions:
    weights: str  # one of WEIGHTS
    group: int | None = None  # int: group size (0 = per channel); fp8: block size (0 = per channel); None: default
    keep_mtp: bool = True
    keep_router: bool = True
    keep_head: bool = True
    keep_embeddings: bool = True
    keep: tuple[str, ...] = ()  # regexes of further modules to keep (searched in the module name)
    calibrate: str | None = None  # a text file: GPTQ rounding on its activations (calibrated.py); None: RTN
    calibration_tokens: int = CALIBRATION_TOKENS
    calibration_window: int = CALIBRATION_WINDOW  # tokens per sequence the calibration text is cut into

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ConfigError(f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.calibrate is not None and self.weights == "fp8":
            raise ConfigError("--calibrate applies to --weights int4 and int8 (fp8 is rounded to nearest)")
        for flag, n in (("--calibration-tokens", self.calibration_tokens),
                        ("--calibration-window", self.calibration_window)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ConfigError(f"{flag} must be a positive integer, got {n!r}")
        if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, int)
                                       or self.group < 0 or (self.group and self.group < MIN_GROUP)):
            raise ConfigError(f"--group must be 0 (per channel) or an integer >= {MIN_GROUP}, got {self.group!r}")
        if self.weights == "int4" and self.group and self.group % 8:
            raise ConfigError(f"--group for int4 must be a multiple of 8, got {self.group}")
        if not self.keep_embeddings:
            raise ConfigError("--no-keep-embeddings: quantized embeddings are not supported (neither this engine "
                              "nor compressed-tensors' Linear targets read them); embeddings are always kept")
        for pattern in self.keep:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"--keep {pattern!r} is not a valid regular expression: {e}") from None

    def scheme(self, group: int | None = None) -> WeightScheme:
        g = self.group if group is None else group
        g = DEFAULT_GROUP[self.weights] if g is None else g
        if self.weights == "fp8":
            return WeightScheme("float", 8, "block" if g else "channel", block=g)
        return WeightScheme("int", 4 if self.weights == "int4" else 8, "group" if g else "channel", group=g)


@dataclass(frozen=True)
class TensorPlan:
    """One source tensor: kept as stored (scheme None) or quantized with `scheme` (per expert when fused)."""

    record: TensorRecord
    scheme: WeightScheme | None
    scale_dtype: torch.dtype | None = None

    @property
    def name(self) -> str:
        return self.record.name


@dataclass
class QuantPlan:
    options: QuantizeOptions
    tensors: list[TensorPlan]
    kept: dict[str, str] = field(default_factory=dict)  # kept linear module -> why
    fitted: dict[str, int] = field(default_factory=dict)  # module -> the group it got instead of --group
    mtp_layers: list[str] = field(default_factory=list)  # module prefixes of the MTP layers

    @property
    def quantized(self) -> int:
        return sum(1 for t in self.tensors if t.scheme is not None)

    def notes(self) -> list[str]:
        """What other readers make of this plan's output (transformers 5.25 with compressed-tensors, checked)."""
        out = []
        quantized = [t.name for t in self.tensors if t.scheme is not None]
        if not self.options.keep_router and any(_ROUTER.search(n.removesuffix(".weight")) for n in quantized):
            out.append("quantized routers: this engine reads them; transformers does not (its MoE routers are "
                       "not Linear modules)")
        if any(".experts." in n for n in quantized):
            if self.options.scheme().strategy == "block":
                out.append("fp8 block-scaled experts: this engine reads them; transformers' MoE loader folds only "
                           "per-channel fp8 scales")
            if any(".experts." in m for m in self.fitted):
                out.append("experts with a fitted group: this engine reads them; transformers' MoE loader "
                           "dequantizes every expert with the first config group's scheme")
            if any(_FUSED.search(n) for n in quantized):
                out.append("fused expert tensors (*_packed / *_scale beside experts.gate_up_proj): this engine "
                           "reads them; transformers does not")
            low = sorted({str(t.scale_dtype).removeprefix("torch.") for t in self.tensors
                          if t.scheme is not None and t.scheme.kind == "int" and ".experts." in t.name
                          and not _FUSED.search(t.name) and t.scale_dtype != torch.float32})
            if low:
                out.append(f"{'/'.join(low)} scales on packed experts: transformers loading this folder with "
                           f"dtype=float32 keeps the experts in {'/'.join(low)} (its MoE loader dequantizes them in "
                           "the scale's dtype); load it in that dtype there (docs/FORMATS.md)")
        if self.fitted:
            out.append("fitted groups: compressed-tensors' checkpoint converter (convert_checkpoint) reads these "
                       "modules with group_0's group size and refuses them; transformers' dense layers, "
                       "compressed-tensors' module matching and this engine take the group naming them "
                       "(docs/FORMATS.md)")
        return out

    def quantization_config(self) -> dict:
        """config.json's `quantization_config` (compressed-tensors): group_0 targets every Linear; each fitted group
        size is a further group naming its modules (compressed-tensors and this engine prefer a target by exact
        name over a class name); `ignore` lists every kept linear module (the MTP layers as one regex each)."""
        main = self.options.scheme()
        groups = {"group_0": {"targets": ["Linear"], "weights": main.config_weights(),
                              "input_activations": None, "output_activations": None, "format": main.format}}
        by_size: dict[int, list[str]] = {}
        for module, g in self.fitted.items():
            by_size.setdefault(g, []).append(module)
        for i, (g, modules) in enumerate(sorted(by_size.items(), reverse=True), 1):
            s = self.options.scheme(g)
            groups[f"group_{i}"] = {"targets": sorted(modules), "weights": s.config_weights(),
                                    "input_activations": None, "output_activations": None, "format": s.format}
        mtp = [f"re:{re.escape(p)}\\..*" for p in self.mtp_layers] if self.options.keep_mtp else []
        ignore = sorted(m for m in self.kept if not (self.options.keep_mtp and _in(m, self.mtp_layers)))
        return {"quant_method": "compressed-tensors", "format": main.format, "quantization_status": "compressed",
                "config_groups": groups, "ignore": ignore + mtp, "kv_cache_scheme": None,
                "global_compression_ratio": None, "sparsity_config": {}}


def _in(module: str, prefixes: list[str]) -> bool:
    return any(module.startswith(p + ".") for p in prefixes)


def mtp_prefixes(names: list[str], num_layers: int) -> list[str]:
    """Module prefixes of the multi-token-prediction layers: DeepSeek's `model.layers.{L + i}` (numbered after the
    decoder's num_hidden_layers) and the hybrids' `mtp`."""
    out = set()
    for name in names:
        m = _LAYER.search(name)
        if m is not None and int(m.group(1)) >= num_layers:
            out.add(name[:m.end() - 1].lstrip("."))
        elif name.startswith("mtp."):
            out.add("mtp")
    return sorted(out)


def fitted_group(inp: int, group: int) -> int:
    """The largest group <= `group` dividing `inp` and at least MIN_GROUP (a multiple of 8 for packing), or 0."""
    for g in range(group, MIN_GROUP - 1, -1):
        if inp % g == 0 and g % 8 == 0:
            return g
    return 0


def make_plan(tensors: Mapping[str, TensorRecord], num_layers: int, options: QuantizeOptions) -> QuantPlan:
    names = list(tensors)
    plan = QuantPlan(options, [], mtp_layers=mtp_prefixes(names, num_layers))
    main = options.scheme()
    for name, rec in tensors.items():
        module = name.removesuffix(".weight")
        fused = _FUSED.search(name) is not None
        linear = (name.endswith(".weight") and len(rec.shape) == 2) or (fused and len(rec.shape) == 3)
        if not linear or rec.dtype not in FLOAT_SOURCES or _EMBED.search(module) or _NORM.search(module.split(".")[-1]):
            plan.tensors.append(TensorPlan(rec, None))
            continue
        why = _keep_reason(module, plan.mtp_layers, options)
        inp = rec.shape[-1]
        scheme = main
        if why is None and main.strategy == "group" and inp % main.group:
            g = fitted_group(inp, main.group)
            if g:
                plan.fitted[module] = g
                scheme = options.scheme(g)
            else:
                why = f"in_features {inp} has no group of {MIN_GROUP}..{main.group} dividing it"
        if why is not None:
            plan.kept[module] = why
            plan.tensors.append(TensorPlan(rec, None))
            continue
        plan.tensors.append(TensorPlan(rec, scheme, FLOAT_SOURCES[rec.dtype]))
    return plan


def _keep_reason(module: str, mtp: list[str], o: QuantizeOptions) -> str | None:
    if _HEAD.search(module) and (o.keep_head or _in(module, mtp)):
        return "head (--keep-head)" if not _in(module, mtp) else "MTP layer's head copy"
    if o.keep_mtp and _in(module, mtp):
        return "MTP layer (--keep-mtp)"
    if o.keep_router and _ROUTER.search(module):
        return "router (--keep-router)"
    if _VISION.search(module):
        return "vision tower (this engine runs the language model)"
    for pattern in o.keep:
        if re.search(pattern, module):
            return f"--keep {pattern}"
    return None
