"""Every weight format by its QuantSpec.kind, and the formats each quantization_config quant_method reads.

A new format is one module beside this one (a WeightFormat subclass: formats/base.py) listed in ALL, plus its
tests (tests/test_weight_formats.py checks that every kind the readers produce is here and answers every method).
"""
from __future__ import annotations

from . import awq, compressed_tensors, fp8_block, gguf, gptq, mxfp4
from .base import WeightFormat
from .spec import QuantSpec

ALL: tuple[WeightFormat, ...] = (fp8_block.FORMAT, compressed_tensors.CT_PACK, compressed_tensors.CT_NAIVE,
                                 gptq.FORMAT, awq.FORMAT, mxfp4.FORMAT, gguf.GGUF, gguf.GGUF_KVB)
FORMATS: dict[str, WeightFormat] = {f.kind: f for f in ALL}
# quant_method -> the format that recognises and plans its weights (compressed-tensors: CT_PACK answers for both
# of its kinds, the tensors present or the scheme's format choosing pack or naive)
METHODS: dict[str, WeightFormat] = {}
for _f in ALL:
    for _m in _f.methods:
        METHODS.setdefault(_m, _f)


def format_of(q: QuantSpec) -> WeightFormat:
    got = FORMATS.get(q.kind)
    if got is None:
        raise ValueError(f"unknown stored weight format {q.kind!r} (formats/registry.py knows "
                         f"{', '.join(FORMATS)})")
    return got


def for_method(method: str) -> WeightFormat | None:
    return METHODS.get(method)
