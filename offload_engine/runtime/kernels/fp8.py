"""CUDA sm90+ (Hopper and later): fp8 weights multiplied in fp8 by torch._scaled_mm.

The activations are quantized on the fly to float8_e4m3fn ("activation_scheme": "dynamic", as the releases run
them): per row for per-channel weights (compressed-tensors float-quantized channel: rowwise scaling), per row and
128 inputs for 128x128-block weights (DeepSeek-V3 / Kimi K2 / Qwen FP8: blockwise 1x128 by 128x128 scaling).
That rounding of the activations makes this path W8A8, not weight-only: its logits differ from the dequantize
path by more than the integer kernels' (docs/FORMATS.md).

torch's requirements for the scale layouts of _scaled_mm vary between releases, and this session had no GPU to
run it: so each mode checks itself once per process on the first weight it meets, against dequantize-then-
matmul on that weight, and turns itself off (the dequantize path then serves, with a warning) if the call fails
or the results disagree.
"""
from __future__ import annotations

import logging

import torch

from ...checkpoint.formats import QuantSpec
from ...formats.registry import format_of

log = logging.getLogger(__name__)
E4M3_MAX = 448.0
ROWWISE, BLOCKWISE = 0, 1
SELF_CHECK_TOLERANCE = 0.05  # relative max error vs dequantize (activation rounding: ~1-2% expected)
_verdict: dict[int, bool] = {}  # mode -> passed its self-check (absent: not checked yet)


def applies(q: QuantSpec, device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(device) < (9, 0) or q.out % 16 or q.inp % 16:
        return False
    scaling = format_of(q).fp8_scaling(q)
    if scaling == "block":
        return q.block == (128, 128) and q.out % 128 == 0 and q.inp % 128 == 0
    return scaling == "channel"


def meta(q: QuantSpec) -> torch.Tensor:
    return torch.tensor([ROWWISE if q.strategy == "channel" else BLOCKWISE], dtype=torch.int64)


def _rowwise(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    sa = x2.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    xq = (x2.float() / sa).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=scale.float().reshape(1, -1).contiguous(),
                            out_dtype=torch.bfloat16)


def _blockwise(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, k = x2.shape
    xb = x2.float().view(m, k // 128, 128)
    sa = xb.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX  # [M, K/128]
    xq = (xb / sa.unsqueeze(-1)).view(m, k).to(torch.float8_e4m3fn)
    # scales outer-dim-major, as torch's blockwise recipe takes them
    sa = sa.t().contiguous().t()
    sb = scale.float().t()  # [K/128, N/128] for mat2 = W.T
    return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _reference(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, mode: int) -> torch.Tensor:
    n, k = w.shape
    if mode == ROWWISE:
        dense = w.float() * scale.float().reshape(n, 1)
    else:
        dense = w.float() * scale.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return x2.float() @ dense.t()


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, info: torch.Tensor) -> torch.Tensor | None:
    mode = int(info[0])
    if _verdict.get(mode) is False or not x.is_cuda:
        return None
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    run = _rowwise if mode == ROWWISE else _blockwise
    if mode not in _verdict:
        try:
            y = run(x2, w, scale).float()
            ref = _reference(x2, w, scale, mode)
            err = (y - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
            _verdict[mode] = err <= SELF_CHECK_TOLERANCE
            if not _verdict[mode]:
                log.warning("fp8 _scaled_mm (%s) off: relative error %.3g vs dequantize", run.__name__, err)
        except RuntimeError as e:
            _verdict[mode] = False
            log.warning("fp8 _scaled_mm (%s) off: %s", run.__name__, e)
        if not _verdict[mode]:
            return None
    return run(x2, w, scale).to(x.dtype).reshape(*lead, -1)
