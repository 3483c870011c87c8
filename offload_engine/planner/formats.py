"""Weight formats as the planner sizes them: which weights a format quantizes, and a unit's bytes under it.

One description serves the checkpoint's own format and the --weights / --expert-weights what-ifs: a quantized
format is a `QuantConfig` (checkpoint/quant_config.py, parsed from config.json's `quantization_config`); each
linear weight it quantizes gets the `QuantSpec` the checkpoint reader (checkpoint/formats.py) would give it, and
its bytes are the bytes of that spec's component tensors (planner/quant_sizes.py). The what-ifs are the configs
tools/make_checkpoint.py --quant writes (fp8 -> fp8-block, int8 -> ct-int8, int4 -> ct-int4), so `plan --weights
int4` places the units `run` would read from such a checkpoint. Where the model is a folder with shards, their
headers give the stored dtype of every tensor a format keeps as it is (norms, routers, embeddings, head).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Mapping

from ..checkpoint.formats import QuantSpec
from ..checkpoint.hf_config import ModelSpec
from ..checkpoint.index import CheckpointIndex
from ..checkpoint.naming import TensorSpec, UnitKey
from ..checkpoint.quant_config import QuantConfig, parse_quant_config
from ..errors import ConfigError, OffloadEngineError
from ..formats.registry import for_method
from .kernel_room import room_for
from .quant_sizes import FLOAT_BITS, describe, nominal_bits, quant_spec_for, quantized_bytes, tensor_bytes

DTYPE_BITS = {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0}
# quantization_config of each quantized --weights what-if: what tools/quant_writers.quant_config writes for
# fp8-block, ct-int8 and ct-int4 (whose scales it stores in float32: quant_sizes.SCALE_DTYPES)
_CT_IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]
WHAT_IF_CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "int8": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": _CT_IGNORE,
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}},
    "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": _CT_IGNORE,
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}},
}
_WHAT_IF = {name: parse_quant_config(raw, Path(f"--weights {name}")) for name, raw in WHAT_IF_CONFIGS.items()}
# bits per weight of each --weights format (a large matrix's: the per-tensor weight_shape left out)
FORMAT_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0,
               **{name: nominal_bits(cfg) for name, cfg in _WHAT_IF.items()}}
SMALL_LOCALS = ("router", "shared_gate", "mlp.gate.weight", "mlp.router.weight")
OWN = ("dense", "expert")


@dataclass(frozen=True)
class WeightFormat:
    """How each class of tensors is stored. `dense` / `expert`: the QuantConfig that quantizes the linear weights
    of dense units (attention, dense MLPs, shared experts, MTP projections) and of routed experts, or None (float,
    at dense_bits / expert_bits). The bits fields summarise the format (reports, what-ifs); unit bytes come from
    the QuantSpec of each weight where one applies."""

    name: str
    dense_bits: float
    expert_bits: float
    embed_bits: float  # embedding and output head
    small_bits: float = 16.0  # 1-D tensors, routers and conv kernels
    dense: QuantConfig | None = None
    expert: QuantConfig | None = None
    own: tuple[str, ...] = ()  # classes in the checkpoint's own format: its headers say which are stored quantized
    stored: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False, repr=False)  # name -> dtype

    @classmethod
    def of(cls, spec: ModelSpec, weights: str | None, expert_weights: str | None = None) -> "WeightFormat":
        fmt = cls._of(spec, weights)
        if expert_weights:
            if expert_weights not in FORMAT_BITS:
                raise ConfigError(f"expert weights {expert_weights!r}: choose one of {', '.join(FORMAT_BITS)}")
            quant = _WHAT_IF.get(expert_weights)
            fmt = dataclasses.replace(fmt, name=f"{fmt.name}; {expert_weights} experts",
                                      expert_bits=FORMAT_BITS[expert_weights], expert=quant,
                                      own=tuple(c for c in fmt.own if c != "expert"))
        return fmt

    @classmethod
    def _of(cls, spec: ModelSpec, weights: str | None) -> "WeightFormat":
        quant = spec.get("quantization_config")
        has_dtype = any(spec.get(k) for k in ("dtype", "torch_dtype"))
        base = DTYPE_BITS.get(spec.dtype, 16.0) if has_dtype or not quant else 16.0
        if weights:
            if weights not in FORMAT_BITS:
                raise ConfigError(f"--weights {weights!r}: choose one of {', '.join(FORMAT_BITS)}")
            bits = FORMAT_BITS[weights]
            what_if = _WHAT_IF.get(weights)
            if what_if is None:  # a float dtype: every tensor in it (fp32 keeps the small ones in fp32 too)
                return cls(weights, bits, bits, bits, 32.0 if weights == "fp32" else 16.0)
            # as tools/quant_writers.py from this checkpoint: the kept tensors as they are stored
            return cls(f"{weights} ({describe(what_if)}; as make_checkpoint --quant writes it)", bits, bits, base,
                       base, what_if, what_if, stored=stored_dtypes(spec))
        cfg = parse_quant_config(quant, spec.path or Path("config.json")) if isinstance(quant, dict) else None
        stored = stored_dtypes(spec)
        if cfg is None:
            name = {32.0: "fp32", 16.0: "bf16" if spec.dtype == "bfloat16" else "fp16"}.get(base, spec.dtype)
            return cls(f"{name} (checkpoint)", base, base, base, base, own=OWN, stored=stored)
        bits = nominal_bits(cfg)
        if cfg.method == "mxfp4":  # gpt-oss: routed experts MXFP4, the rest bf16
            return cls(f"{describe(cfg)} (checkpoint)", base, bits, base, base, None, cfg, OWN, stored)
        return cls(f"{describe(cfg)} (checkpoint)", bits, bits, base, base, cfg, cfg, OWN, stored)

    def bits(self, kind: str, local: str, ts: TensorSpec) -> float:
        """Bits per weight of a tensor stored as a float (not quantized)."""
        if len(ts.shape) < 2 or local in SMALL_LOCALS or "conv1d" in local:
            return self.small_bits
        if kind == "expert":
            return self.expert_bits
        return self.embed_bits if kind in ("embed", "head") else self.dense_bits

    def tensor_bytes(self, kind: str, local: str, ts: TensorSpec) -> int:
        """Bytes of one unit tensor: a quantized weight's components, else the tensor as stored (the shard headers
        where the format reads them), else at the format's bits."""
        own = ("expert" if kind == "expert" else "dense") in self.own
        cfg = self.expert if kind == "expert" else self.dense
        stored = self.stored.get(ts.hf_name)
        q = quant_spec_for(cfg, kind, ts) if cfg is not None else None
        if q is not None and not (own and stored in FLOAT_BITS):  # a float weight of its own checkpoint: kept
            return quantized_bytes(q, self.scale_for(cfg, ts) if own else None)
        if stored in FLOAT_BITS:
            return tensor_bytes(ts.numel, FLOAT_BITS[stored])
        return math.ceil(ts.numel * self.bits(kind, local, ts) / 8)

    def quantized_spec(self, kind: str, ts: TensorSpec) -> QuantSpec | None:
        """The QuantSpec this format stores tensor `ts` with, or None where it is kept as a float."""
        own = ("expert" if kind == "expert" else "dense") in self.own
        cfg = self.expert if kind == "expert" else self.dense
        q = quant_spec_for(cfg, kind, ts) if cfg is not None else None
        return None if q is None or (own and self.stored.get(ts.hf_name) in FLOAT_BITS) else q

    def scale_for(self, cfg: QuantConfig, ts: TensorSpec) -> str | None:
        """The scales' dtype as stored (the checkpoint's own format); None: the format's default."""
        if self.stored:
            for name in _scale_names(cfg.method, ts.hf_name):
                if name in self.stored:
                    return self.stored[name]
        return None


def _scale_names(method: str, hf_name: str) -> tuple[str, ...]:
    fmt = for_method(method)
    return fmt.scale_names(hf_name) if fmt is not None else ()


def stored_dtypes(spec: ModelSpec) -> Mapping[str, str]:
    """name -> safetensors dtype from the shard headers of the folder spec's config.json is in ({} for a config
    without shards beside it, or shards the headers of which cannot be read: the sizes then come from config.json
    alone, as for configs/models)."""
    folder = Path(spec.path).parent if spec.path else None
    if folder is None:
        return {}
    try:
        shards = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.glob("*.safetensors")))
    except OSError:  # a dangling shard link: `run` names it; the plan sizes from config.json
        return {}
    return _stored(str(folder), shards) if shards else {}


@lru_cache(maxsize=8)
def _stored(folder: str, shards: tuple) -> Mapping[str, str]:
    """Cached per folder and shard state (plan() and its what-ifs ask many times; a rewritten folder is new)."""
    try:
        index = CheckpointIndex.open(folder)
    except OffloadEngineError:  # planning needs no weights: a folder `run` refuses still gets a plan
        return {}
    return {name: rec.dtype for name, rec in index.tensors.items()}


def unit_bytes(key: UnitKey, specs: Mapping[str, TensorSpec], fmt: WeightFormat, kernel_itemsize: int = 0) -> int:
    """A unit's bytes under `fmt`: its tensors' bytes, without the alignment padding between them that a unit's
    blob adds (checkpoint/layout.py: at most the element size of each tensor less one byte); with
    `kernel_itemsize` (the CPU's compute dtype), plus the room its slot keeps for the CPU kernels' forms."""
    room = 0
    if kernel_itemsize:
        quantized = (fmt.quantized_spec(key.kind, ts) for ts in specs.values())
        room = room_for((q for q in quantized if q is not None), kernel_itemsize)
    return room + sum(fmt.tensor_bytes(key.kind, local, ts) for local, ts in specs.items())
