"""MXFP4 (quant_method "mxfp4", gpt-oss's routed experts): `_blocks` [out, in/32, 16] of two e2m1 values per byte
(low nibble first) and `_scales` [out, in/32] of e8m0 exponents (bias 127) per 32 values. No CPU kernel form of
its own in a safetensors checkpoint: dequantized (GGUF's MXFP4 blocks are formats/gguf.py's)."""
from __future__ import annotations

import torch

from ..checkpoint.quant_config import QuantConfig
from ..errors import CheckpointFormatError
from .base import Parts, WeightFormat
from .packing import F32
from .spec import QuantSpec, Recognition, compute_dtype, part_name, primary_name

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4(WeightFormat):
    kind = "mxfp4"
    methods = ("mxfp4",)
    scale_dtype = "U8"  # e8m0 bytes

    def recognise(self, c: Recognition, cfg: QuantConfig) -> QuantSpec | None:
        blocks = c.get(c.spec.hf_name + "_blocks")
        if blocks is None:
            return None
        if c.inp % 32:
            raise CheckpointFormatError(blocks.file, f"in_features {c.inp} is not a multiple of the 32-value MXFP4 "
                                                     f"block", tensor=blocks.name)
        q = QuantSpec(self.kind, c.out, c.inp, bits=4, group=32)
        c.add(primary_name(c.local, q), blocks, (c.out, c.inp // 32, 16), ("U8",), "MXFP4 blocks")
        c.add(part_name(c.local, "scale"), c.need(c.spec.hf_name + "_scales", "scales", blocks),
              (c.out, c.inp // 32), ("U8",), "MXFP4 scales (e8m0)")
        return q

    def planned(self, cfg: QuantConfig, unit_kind: str, module: str, out: int, inp: int) -> QuantSpec | None:
        return QuantSpec(self.kind, out, inp, bits=4, group=32) if unit_kind == "expert" else None  # experts only

    def label(self, q: QuantSpec) -> str:
        return q.kind

    def parts(self, q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"q": ((q.out, q.inp // 32, 16), "U8"), "scale": ((q.out, q.inp // 32), "U8")}

    def dequantize(self, q: QuantSpec, parts: Parts, dtype: torch.dtype | None) -> torch.Tensor:
        data, scale = parts["data"], parts["scale"]
        return dequantize_mxfp4(data, scale, q, compute_dtype(scale, dtype))


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, q: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    lut = torch.tensor(FP4_VALUES, dtype=F32, device=blocks.device)
    pairs = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [out, in/32, 16, 2]
    values = pairs.reshape(q.out, q.inp // 32, 32)
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).reshape(q.out, q.inp).to(dtype)


FORMAT = Mxfp4()
