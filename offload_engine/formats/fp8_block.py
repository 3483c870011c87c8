"""fp8 block (DeepSeek-V3 / Kimi K2 / Qwen FP8: quantization_config quant_method "fp8"): e4m3 values, one float32
`weight_scale_inv` per b0 x b1 block; W = q * scale_inv[i // b0, j // b1]. No CPU fp8 matmul: on a CPU the kernel
form is the dense matrix made once per fill (cpu_dense); on CUDA sm90+ 128x128 blocks take torch._scaled_mm."""
from __future__ import annotations

import fnmatch

import torch

from ..checkpoint.quant_config import QuantConfig
from .base import Parts, WeightFormat
from .packing import F32, expand, float32_of
from .spec import F8, FLOATS, QuantSpec, Recognition, ceil_div, compute_dtype, part_name, primary_name


def not_converted(module: str, patterns: tuple[str, ...]) -> bool:
    """fp8 modules_to_not_convert: a module name, a prefix of it, or a glob (gpt-oss: 'model.layers.*.self_attn')."""
    return any(module == p or module.startswith(p + ".") or fnmatch.fnmatch(module, p)
               or fnmatch.fnmatch(module, p + ".*") for p in patterns)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, q: QuantSpec, dtype: torch.dtype
                         ) -> torch.Tensor:
    b0, b1 = q.block
    if q.strategy == "block" and q.out % b0 == 0 and q.inp % b1 == 0:  # whole blocks: broadcast, no [out, in] scale
        x = float32_of(weight).view(q.out // b0, b0, q.inp // b1, b1)
        return (x * scale_inv.to(F32).view(q.out // b0, 1, q.inp // b1, 1)).view(q.out, q.inp).to(dtype)
    return (float32_of(weight) * expand(scale_inv.to(F32), q.out, q.inp, q)).to(dtype)


class Fp8Block(WeightFormat):
    kind = "fp8_block"
    methods = ("fp8",)
    scale_dtype = "F32"  # weight_scale_inv is float32 in the releases

    def recognise(self, c: Recognition, cfg: QuantConfig) -> QuantSpec | None:
        rec = c.get(c.spec.hf_name)
        if rec is None or rec.dtype not in F8:
            return None  # kept in bf16 (norms, router, modules_to_not_convert) or missing (reported elsewhere)
        b0, b1 = cfg.block
        q = QuantSpec(self.kind, c.out, c.inp, strategy="block", block=(b0, b1))
        scale = c.need(c.spec.hf_name + "_scale_inv", "scale", rec)
        c.add(primary_name(c.local, q), rec, (c.out, c.inp), F8, "fp8 weight")
        c.add(part_name(c.local, "scale"), scale, (ceil_div(c.out, b0), ceil_div(c.inp, b1)), FLOATS,
              f"weight_scale_inv (blocks of {b0}x{b1})")
        return q

    def planned(self, cfg: QuantConfig, unit_kind: str, module: str, out: int, inp: int) -> QuantSpec | None:
        if not_converted(module, cfg.not_convert):
            return None
        return QuantSpec(self.kind, out, inp, strategy="block", block=cfg.block or (128, 128))

    def scale_names(self, hf_name: str) -> tuple[str, ...]:
        return (hf_name + "_scale_inv",)

    def label(self, q: QuantSpec) -> str:
        return q.kind

    def parts(self, q: QuantSpec, scale_dtype: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"q": ((q.out, q.inp), "F8_E4M3"),
                "scale": ((ceil_div(q.out, q.block[0]), ceil_div(q.inp, q.block[1])), scale_dtype or self.scale_dtype)}

    def cpu_path(self, q: QuantSpec, gguf_native: bool = False) -> str | None:
        return "cpu_dense"

    def fp8_scaling(self, q: QuantSpec) -> str | None:
        return "block"

    def dequantize(self, q: QuantSpec, parts: Parts, dtype: torch.dtype | None) -> torch.Tensor:
        data, scale = parts["data"], parts["scale"]
        return dequantize_fp8_block(data, scale, q, compute_dtype(scale, dtype))


FORMAT = Fp8Block()
