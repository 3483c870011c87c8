"""WeightFormat: what the engine asks of one stored weight format, answered by the format's own module.

A format object is registered under its QuantSpec.kind (formats/registry.py). It answers:
  recognition   `methods` (the quantization_config quant_method values it reads), `recognise` (a weight's
                component headers checked, the QuantSpec), `planned` (the QuantSpec a checkpoint in that config
                gives a weight: the planner's what-ifs and sizes)
  bytes         `parts` (component shapes and safetensors dtypes), `scale_dtype` (the scales' default dtype),
                `scale_names` (the tensors whose header says the scales' dtype)
  kernel form   `cpu_path` (cpu_int4 | cpu_int8 | cpu_dense | cpu_gguf | None), `int4_group`, `int4_parts`,
                `int8_parts`, `int8_as_stored`, `triton_int`, `fp8_scaling` (CUDA)
  math          `dequantize` (the dense [out, in] matrix), `rows` (an embedding lookup without the whole table)
The defaults say "not this format's": no kernel form, no CUDA path, no row lookup.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from ..checkpoint.quant_config import QuantConfig
from .spec import DTYPE_BYTES, QuantSpec, Recognition

Parts = Mapping[str, torch.Tensor | None]  # "data", "scale", "zero", "g_idx" (dict or spec.Components)
INT4_GROUPS = (256, 128, 64, 32)  # the CPU int4 kernel's group sizes, largest first


def span(q: QuantSpec) -> int:
    """Inputs per scale group (all of them for channel strategies and one-group weights)."""
    return q.inp if q.strategy == "channel" or q.group == 0 else q.group


def int4_group_of(q: QuantSpec) -> int | None:
    """The CPU int4 kernel's group size for a weight grouping `span(q)` inputs: the largest kernel size dividing
    it (scales repeated), or None."""
    if q.out % 16 or q.inp % 2:
        return None
    return next((g for g in INT4_GROUPS if span(q) % g == 0 and q.inp % g == 0), None)


class WeightFormat:
    kind: str = ""
    methods: tuple[str, ...] = ()
    scale_dtype: str = ""
    int8_as_stored: bool = False  # the stored int8 matrix is the int8 kernel's data (no copy: int-quantized)

    # ---- recognition -------------------------------------------------------------------------------------
    def recognise(self, c: Recognition, cfg: QuantConfig) -> QuantSpec | None:
        """The QuantSpec of the weight `c` describes, its components added to `c` with headers checked, or None
        where the checkpoint keeps it as stored."""
        return None

    def planned(self, cfg: QuantConfig, unit_kind: str, module: str, out: int, inp: int) -> QuantSpec | None:
        """The QuantSpec a checkpoint quantized by `cfg` stores linear weight `module` [out, in] with, or None."""
        return None

    def scale_names(self, hf_name: str) -> tuple[str, ...]:
        """The checkpoint tensors holding weight `hf_name`'s scales (the planner reads their stored dtype)."""
        return ()

    def label(self, q: QuantSpec) -> str:
        """inspect's summary label, e.g. 'ct_pack 4-bit'."""
        return f"{q.kind} {q.bits}-bit"

    # ---- bytes ---------------------------------------------------------------------------------------------
    def parts(self, q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """part -> (shape, safetensors dtype) of the tensors that store the weight `q` describes."""
        raise NotImplementedError

    def nbytes(self, q: QuantSpec, scale_dtype: str | None = None) -> int:
        return sum(math.prod(shape) * DTYPE_BYTES[dtype] for shape, dtype in self.parts(q, scale_dtype).values())

    # ---- kernel forms ---------------------------------------------------------------------------------------
    def cpu_path(self, q: QuantSpec, gguf_native: bool = False) -> str | None:
        return None

    def int4_group(self, q: QuantSpec) -> int | None:
        return int4_group_of(q)

    def int4_parts(self, q: QuantSpec, parts: Parts
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int] | None:
        """(q bytes uint8 [N, K/2] (value k low nibble, k + 1 high, stored value + 8), scale [N, G] float32,
        additive term [N, G] or None, inputs per G) with W = (q - 8) * scale + term per group, or None."""
        return None

    def int8_parts(self, q: QuantSpec, parts: Parts) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(int8 [N, K], zero point [N] or None) with W = (q - zero) * scale per output channel, or None."""
        return None

    def triton_int(self, q: QuantSpec) -> bool:
        """CUDA: the triton kernel reads the stored int words (runtime/kernels/triton_int.py)."""
        return False

    def fp8_scaling(self, q: QuantSpec) -> str | None:
        """CUDA sm90+: "block" / "channel" where fp8 values take torch._scaled_mm, else None."""
        return None

    # ---- math -------------------------------------------------------------------------------------------------
    def dequantize(self, q: QuantSpec, parts: Parts, dtype: torch.dtype | None) -> torch.Tensor:
        """The dense [out, in] weight in `dtype` (None: the scales' float dtype, else float32)."""
        raise NotImplementedError

    def rows(self, q: QuantSpec, parts: Parts, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """An embedding lookup decoding only the rows asked for, or None (the caller dequantizes the table)."""
        return None
