"""`quantize --calibrate`: convert.py's rows rounded by GPTQ (gptq.py) on the inputs each weight saw in the
calibration text (activations.py), layer by layer. convert.py writes the tensors in the order `order` gives (a
layer's tensors together, layers ascending), and asks `rounding(tp, expert)` for each weight's row function:
None means round to nearest (weights no calibration token reached: MTP layers, experts never routed to, weights
not multiplied as a plain linear such as MLA's absorbed kv_b). Memory: the units of one layer in float32, the
residual stream of every window, one weight's Hessian and its factors, and the inputs one layer's weights saw,
all within half of --ram (checked before and while running, refused by naming --ram)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..checkpoint.opened import ModelCheckpoint
from ..errors import ConfigError
from ..units import format_bytes
from .activations import LayerCollector
from .gptq import inverse_factor, gptq_rows
from .plan import QuantPlan, TensorPlan
from .writer import SourceReader

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HEAD = re.compile(r"(^|\.)lm_head\.weight$")
HESSIAN_COPIES = 6  # H, its damped copy, the Cholesky factor, the inverse, its factor, the error product
STREAM_COPIES = 4  # each window's residual stream, the layer's output, the normed input, one projection

RowFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class GptqRounding:
    checkpoint: ModelCheckpoint
    plan: QuantPlan
    reader: SourceReader
    windows: list[torch.Tensor]
    ram: int
    tokens: int = 0
    gptq: int = 0  # weights (experts counted one by one) rounded with GPTQ
    rows_better: int = 0  # of their rows, those GPTQ rounded with less error than RTN (the others keep RTN's)
    rows: int = 0
    fallback: dict[str, int] = field(default_factory=dict)  # why -> weights rounded to nearest instead
    describe: Callable[[str], None] = lambda text: None  # the progress bar's description (convert.py sets it)

    def __post_init__(self) -> None:
        self.num_layers = self.checkpoint.spec.num_layers
        self.tokens = sum(len(w) for w in self.windows)
        quantized = {tp.name for tp in self.plan.tensors if tp.scheme is not None}
        fixed = self._fixed_bytes(quantized)
        if fixed > self.ram // 2:
            raise ConfigError(f"--ram {format_bytes(self.ram)} is too small for --calibrate: one layer's units in "
                              f"float32, the calibration stream and one Hessian need {format_bytes(2 * fixed)}")
        self.collector = LayerCollector(self.checkpoint, self.reader, self.windows, quantized,
                                        limit=self.ram // 2 - fixed)
        self.layer: int | None = None
        self.grams: dict = {}

    def _fixed_bytes(self, quantized: set[str]) -> int:
        c = self.checkpoint
        units = {"dense": 0, "expert": 0}
        for key, layout in c.layouts.items():
            if key.kind in units:
                units[key.kind] = max(units[key.kind], 2 * sum(4 * int(torch.Size(s.shape).numel())
                                                               for s in layout.slices))
        widest = max((c.index.tensors[n].shape[-1] for n in quantized), default=0)
        stream = STREAM_COPIES * 4 * self.tokens * c.spec.hidden_size
        return units["dense"] + units["expert"] + stream + HESSIAN_COPIES * 4 * widest * widest

    def layer_of(self, name: str) -> int | None:
        """The decoder layer whose forward a weight's inputs come from (num_layers: the head); None: none (the MTP
        layers, DeepSeek's numbered after the decoder's and the hybrids' `mtp.layers.*`, and what lies outside)."""
        if any(name.startswith(p + ".") for p in self.plan.mtp_layers):
            return None
        m = _LAYER.search(name)
        if m is not None:
            return int(m.group(1)) if int(m.group(1)) < self.num_layers else None
        return self.num_layers if _HEAD.search(name) else None

    def order(self, tensors: list[TensorPlan]) -> list[TensorPlan]:
        """Tensors outside the calibrated forward first, then layer by layer, then the head (stable otherwise)."""
        def key(tp: TensorPlan) -> int:
            layer = self.layer_of(tp.name)
            return -1 if layer is None else layer
        return sorted(tensors, key=key)

    def rounding(self, tp: TensorPlan, expert: int) -> RowFn | None:
        if tp.scheme is None or tp.scheme.kind != "int":
            return None
        layer = self.layer_of(tp.name)
        if layer is None:
            return self._fall_back("outside the calibrated forward (MTP layers)")
        if layer != self.layer:
            self.grams = {}  # the previous layer's inputs go before this layer's are collected
            self.describe(f"calibrating {'layer ' + str(layer) if layer < self.num_layers else 'head'}")
            self.grams = self.collector.collect(layer)
            self.describe("quantizing (GPTQ)")
            self.layer = layer
        gram = self.grams.get((tp.name, expert))
        if gram is None or gram.tokens == 0:
            why = "experts no calibration token was routed to" if ".experts." in tp.name else \
                "not multiplied as a plain linear in the forward"
            return self._fall_back(why)
        h = gram.hessian()
        hinv = inverse_factor(h)
        self.gptq += 1

        def rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            values, scale, better = gptq_rows(w, hinv, h, tp.scheme, tp.scale_dtype)
            self.rows_better += better
            self.rows += w.shape[0]
            return values, scale
        return rows

    def _fall_back(self, why: str) -> None:
        self.fallback[why] = self.fallback.get(why, 0) + 1
        return None

    def notes(self) -> list[str]:
        out = [f"--calibrate: {self.tokens} tokens; {self.gptq} weights rounded by GPTQ ({self.rows_better} of "
               f"{self.rows} rows beat round-to-nearest on the calibration inputs; the rest kept RTN's)"]
        out += [f"--calibrate: {n} weights rounded to nearest: {why}" for why, n in sorted(self.fallback.items())]
        return out
