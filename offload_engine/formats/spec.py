"""A quantized weight's description (QuantSpec), the names of its component tensors inside a unit, and the
header checks every format's recogniser shares (Recognition).

Component local names carry the weight's `QuantSpec`: the quantized data is `<local>@q:<tag>` and the others
`<local>@scale`, `@zero`, `@g_idx`, `@shape` (GGUF's split kv_b: `@vb`), so a unit's tensors describe themselves
wherever they are handed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import torch

from ..checkpoint.index import TensorRecord
from ..checkpoint.naming import TensorSpec
from ..errors import CheckpointFormatError

MARK, PRIMARY = "@", "@q:"
PARTS = ("scale", "zero", "g_idx", "shape")
FLOATS = ("F32", "BF16", "F16")
F8 = ("F8_E4M3",)
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1}
F32 = torch.float32


@dataclass(frozen=True)
class QuantSpec:
    """How one weight [out, in] is stored. kind: the registered WeightFormat's (formats/registry.py): fp8_block |
    ct_pack | ct_naive | gptq | awq | mxfp4 | gguf | gguf_kvb."""

    kind: str
    out: int
    inp: int
    bits: int = 8
    strategy: str = "group"  # group | channel | block | tensor
    group: int = 0  # input features per scale (group strategy, gptq/awq; 0: one group over all inputs)
    block: tuple[int, int] = (0, 0)  # fp8 block / CT block strategy
    symmetric: bool = True
    float_values: bool = False  # CT float-quantized (fp8 values)
    zero_offset: int = 0  # gptq v1 stores zero - 1
    gtype: str = ""  # gguf: the GGUF tensor type of the data (F32, Q4_K, ...)
    gtype2: str = ""  # gguf_kvb: the type of the second part (v_b)
    heads: int = 0  # gguf: rows permuted by llama.cpp's rope permutation over this many heads (0: none)

    @property
    def tag(self) -> str:
        return encode(self)


def encode(q: QuantSpec) -> str:
    return ",".join(f"{f.name}={_text(getattr(q, f.name))}" for f in dataclasses.fields(q))


def _text(v) -> str:
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(int(v) if isinstance(v, bool) else v)


@lru_cache(maxsize=4096)
def decode(tag: str) -> QuantSpec:
    fields = {f.name: f for f in dataclasses.fields(QuantSpec)}
    kw = {}
    for item in tag.split(","):
        name, value = item.split("=", 1)
        default = fields[name].default
        if isinstance(default, bool):
            kw[name] = value == "1"
        elif isinstance(default, tuple):
            kw[name] = tuple(int(x) for x in value.split("x"))
        elif name in ("kind", "strategy", "gtype", "gtype2"):
            kw[name] = value
        else:
            kw[name] = int(value)
    return QuantSpec(**kw)


def primary_name(local: str, q: QuantSpec) -> str:
    return f"{local}{PRIMARY}{q.tag}"


def part_name(local: str, part: str) -> str:
    return f"{local}{MARK}{part}"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def compute_dtype(scale: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dequantized weight's dtype where the caller names none: the scales' float dtype, else float32."""
    if dtype is not None:
        return dtype
    return scale.dtype if scale.is_floating_point() else F32


class Components:
    """One quantized weight's stored tensors in a unit's Weights, by part: "data" (the `@q:` tensor), "scale",
    "zero", "g_idx", "vb"; `[part]` raises KeyError where the unit lacks it, `get(part)` says None."""

    def __init__(self, w: Mapping[str, torch.Tensor], name: str, data: torch.Tensor):
        self.w, self.name, self.data = w, name, data

    def __getitem__(self, part: str) -> torch.Tensor:
        return self.data if part == "data" else self.w[part_name(self.name, part)]

    def get(self, part: str) -> torch.Tensor | None:
        return self.data if part == "data" else self.w.get(part_name(self.name, part))


class Recognition:
    """One weight being recognised: its logical spec, and helpers that fetch and check component headers."""

    def __init__(self, local: str, spec: TensorSpec, tensors: Mapping[str, TensorRecord]):
        self.local, self.spec, self.tensors = local, spec, tensors
        self.out, self.inp = spec.shape
        self.parts: dict[str, TensorSpec] = {}

    def get(self, name: str) -> TensorRecord | None:
        return self.tensors.get(name)

    def need(self, name: str, what: str, beside: TensorRecord) -> TensorRecord:
        rec = self.tensors.get(name)
        if rec is None:
            raise CheckpointFormatError(beside.file, f"{what} tensor '{name}' missing for quantized weight "
                                                     f"'{beside.name}'", tensor=name)
        return rec

    def add(self, local: str, rec: TensorRecord, shape: tuple[int, ...], dtypes: tuple[str, ...], what: str) -> None:
        """Component `rec` must have `shape` (per expert for fused [E, ...] tensors) and one of `dtypes`."""
        index = self.spec.index
        got = tuple(rec.shape)
        if index is not None:
            if len(got) != len(shape) + 1 or got[0] <= index:
                raise CheckpointFormatError(rec.file, f"{what} of shape {list(got)} does not hold expert {index} "
                                                      f"of shape {list(shape)}", tensor=rec.name)
            got = got[1:]
        if got != tuple(shape):
            raise CheckpointFormatError(rec.file, f"{what} has shape {list(rec.shape)}, expected "
                                                  f"{'[E, ' if index is not None else '['}"
                                                  f"{', '.join(map(str, shape))}] for a [{self.out}, {self.inp}] "
                                                  f"weight", tensor=rec.name)
        if rec.dtype not in dtypes:
            raise CheckpointFormatError(rec.file, f"{what} has dtype {rec.dtype}, expected one of "
                                                  f"{', '.join(dtypes)}", tensor=rec.name)
        self.parts[local] = TensorSpec(rec.name, tuple(shape), index=index, dtype=rec.dtype)
