"""Bits per weight of each weight format, and a unit's bytes under one: the sizes `plan` places when it
predicts for a format other than the checkpoint's own (--weights, --expert-weights)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping

from ..checkpoint.hf_config import ModelSpec
from ..checkpoint.naming import TensorSpec, UnitKey
from ..errors import ConfigError

# bits per weight of each --weights format, scales included: fp8 with 128x128 fp32 block scales (DeepSeek-V3
# style); int8 and int4 as llama.cpp's Q8_0 / Q4_0 (32-weight blocks with an fp16 scale: 8.5 and 4.5 bits)
FORMAT_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0 + 32 / (128 * 128), "int8": 8.5, "int4": 4.5}
DTYPE_BITS = {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0}
QUANT_BITS = {"fp8": FORMAT_BITS["fp8"], "mxfp4": 4.25}  # released checkpoints' quantization_config
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
