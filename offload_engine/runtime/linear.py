"""The runtime's one seam to weight formats: a unit's linear weight by local name, as a dense matrix.

`dense(w, name, dtype)` returns `w[name]` when the unit holds it as a plain tensor, and otherwise dequantizes it
from its stored components (checkpoint/formats.py names them `<name>@q:<tag>`, `<name>@scale`, ...) into a
scratch tensor of the compute dtype on the weights' device (the weight's format does it: formats/). Nothing is
cached: the unit's bytes stay quantized in every tier (bytes moved = bytes on disk) and the dense copy lives only
while the op that asked uses it.

`linear(x, w, name)` first asks runtime/kernels/select.py for a fast path: the kernel forms the store added to
the unit when its views were built (EngineConfig.kernels "auto"); without them it dequantizes then multiplies
(formats/: WeightFormat.dequantize). docs/FORMATS.md says which path each format takes on each device.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from ..checkpoint.formats import PRIMARY, decode
from ..formats.registry import format_of
from ..formats.spec import Components
from .kernels import decode as decode_kernels
from .kernels.select import W as KERNEL_FORM
from .kernels.select import fast_linear, kernel_dense

Weights = Mapping[str, torch.Tensor]


def is_quantized(w: Weights, name: str) -> bool:
    return name not in w and (_primary(w, name) is not None or name + KERNEL_FORM in w)


def _primary(w: Weights, name: str) -> str | None:
    prefix = name + PRIMARY
    for key in w:
        if key.startswith(prefix):
            return key
    return None


def dense(w: Weights, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight `name` of unit `w` as a dense [out, in] tensor (dtype: the compute dtype, for quantized
    weights; plain ones are returned as the source holds them, already in it)."""
    plain = w.get(name)
    if plain is not None:
        return plain
    key = _primary(w, name)
    if key is None:
        got = kernel_dense(w, name, dtype or torch.float32)  # the stored data became the kernel form in place
        if got is None:
            raise KeyError(name)
        return got
    q = decode(key[len(name) + len(PRIMARY):])
    return format_of(q).dequantize(q, Components(w, name, w[key]), dtype)


def embedding(w: Weights, name: str, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """F.embedding on table `name`; a table stored in a GGUF block type decodes only the rows looked up."""
    plain = w.get(name)
    if plain is not None:
        return F.embedding(tokens, plain)
    key = _primary(w, name)
    if key is None:
        raise KeyError(name)
    q = decode(key[len(name) + len(PRIMARY):])
    got = format_of(q).rows(q, Components(w, name, w[key]), tokens, dtype)
    if got is not None:  # a GGUF table decodes only the rows looked up
        return got
    return F.embedding(tokens, dense(w, name, dtype))


def linear(x: torch.Tensor, w: Weights, name: str, bias: str | None = None,
           kernels: "decode_kernels.DecodeKernels | None" = None) -> torch.Tensor:
    """F.linear(x, weight `name`, bias `bias` if the unit has it), whatever format the weight is stored in; a
    plain or int8 / int4 weight takes the native decode kernel where it was chosen for its shape
    (kernels/decode.py: `kernels`, the model's, which its ops pass on)."""
    plain = w.get(name)
    if plain is not None:
        y = kernels.linear(x, plain) if kernels is not None else None
    else:
        y = kernels.int_linear(x, w, name) if kernels is not None else None
        if y is None:
            y = fast_linear(x, w, name)
    if y is None:
        return F.linear(x, dense(w, name, x.dtype) if plain is None else plain, None if bias is None else w.get(bias))
    b = None if bias is None else w.get(bias)
    return y if b is None else y + b


def linears(x: torch.Tensor, w: Weights, names: list[str], biases: list[str | None],
            kernels: "decode_kernels.DecodeKernels | None" = None) -> list[torch.Tensor]:
    """linear() of one input by several weights of the unit (an attention's q, k and v): one native call where
    they all take the same native kernel (kernels/decode.py DecodeKernels.linears), the same bits as one by one."""
    ys = kernels.linears(x, w, names) if kernels is not None else None
    if ys is None:
        return [linear(x, w, name, bias, kernels) for name, bias in zip(names, biases)]
    added = [None if bias is None else w.get(bias) for bias in biases]
    return [y if b is None else y + b for y, b in zip(ys, added)]
