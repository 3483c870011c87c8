"""GPTQ (Frantar et al. 2022): int rounding with error feedback, for `quantize --calibrate`.

A linear layer's output error on inputs X is ||(W - Q) X^T||^2 = sum over rows r of (w_r - q_r) H (w_r - q_r)^T with
H = X^T X. Columns are quantized one at a time and each one's rounding error, scaled by the inverse Hessian, is
pushed onto the columns not yet quantized (in blocks, the update of later blocks done in one product). Rows are
independent given H, so they are computed in chunks like round-to-nearest; the stored layout (values, scales) is
scheme.py's, so the output is an ordinary compressed-tensors checkpoint. A group's scale is taken from its
columns as they stand when the group is reached (after the feedback from earlier columns). Each row finally keeps
whichever of its GPTQ and round-to-nearest results has the lower error on H, so no row is worse than RTN.
"""
from __future__ import annotations

import torch

from .scheme import WeightScheme, _stored_scale, pack_int32, quantize_rows

DAMP = 0.01  # added to H's diagonal, as a fraction of its mean: keeps the Cholesky factorization defined
BLOCK = 128  # columns per lazy-update block (a multiple of the group, see _block)


def inverse_factor(h: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """The upper Cholesky factor of H^-1 (H damped; inputs never seen, H[i, i] == 0, get a unit diagonal so their
    columns are rounded without feedback). float32, as GPTQ's reference does: a few copies of [in, in]."""
    h = h.float().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    mean = float(torch.diagonal(h).mean())
    h.diagonal().add_(damp * mean if mean > 0 else damp)
    for attempt in range(6):  # a near-singular H (few calibration tokens) gets more damping until it factors
        factor, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            break
        h.diagonal().add_(damp * mean * 10 ** attempt)
    else:
        raise ValueError("the calibration Hessian is not positive definite even after damping")
    inverse = torch.cholesky_inverse(factor)
    return torch.linalg.cholesky(inverse, upper=True)


def _block(s: WeightScheme, inp: int) -> int:
    if s.strategy == "group":
        return max(s.group, BLOCK // s.group * s.group)
    return min(BLOCK, inp)


def gptq_rows(w: torch.Tensor, hinv: torch.Tensor, h: torch.Tensor, s: WeightScheme, scale_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows [r, in] of a weight -> (packed int32 values, scale rows, rows where GPTQ beat RTN), in quantize_rows'
    layout. hinv: inverse_factor(H); h: H itself (to compare each row's error with round-to-nearest's)."""
    if s.kind != "int":
        raise ValueError("GPTQ applies to int schemes")
    w = w.float()
    rows, inp = w.shape
    qmax = float((1 << (s.bits - 1)) - 1)
    per = s.group if s.strategy == "group" else inp
    scale = torch.empty(rows, inp // per, dtype=scale_dtype)
    if s.strategy != "group":  # one scale per row, from the weights as they are
        scale[:, 0] = _stored_scale(w.abs().amax(-1) / qmax, scale_dtype)
    work = w.clone()
    q = torch.empty(rows, inp, dtype=torch.int8)
    step = _block(s, inp)
    for b0 in range(0, inp, step):
        b1 = min(b0 + step, inp)
        block = work[:, b0:b1]  # a view: updated in place
        errors = torch.empty(rows, b1 - b0)
        for i in range(b1 - b0):
            col = b0 + i
            if col % per == 0 and s.strategy == "group":
                scale[:, col // per] = _stored_scale(block[:, i:i + per].abs().amax(-1) / qmax, scale_dtype)
            sc = scale[:, col // per].float()
            v = block[:, i]
            qi = (v / sc).round_().clamp_(-qmax - 1, qmax)
            q[:, col] = qi.to(torch.int8)
            err = (v - qi * sc) / hinv[col, col]
            block[:, i:] -= err[:, None] * hinv[col, b0 + i:b1][None, :]
            errors[:, i] = err
        work[:, b1:] -= errors @ hinv[b0:b1, b1:]
    rtn_values, rtn_scale = quantize_rows(w, s, scale_dtype)
    gptq_err = row_error(w, dequantize_int(q, scale, per), h)
    rtn_err = row_error(w, dequantize_int(unpack_int32(rtn_values, s.bits, inp), rtn_scale, per), h)
    better = gptq_err <= rtn_err
    values = torch.where(better[:, None], pack_int32(q, s.bits), rtn_values)
    return values, torch.where(better[:, None], scale, rtn_scale), int(better.sum())


def row_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Each row's output error on the calibration inputs: (w - wq) H (w - wq)^T."""
    d = w.float() - wq
    return ((d @ h.float()) * d).sum(-1)


def dequantize_int(q: torch.Tensor, scale: torch.Tensor, per: int) -> torch.Tensor:
    rows, inp = q.shape
    return (q.float().view(rows, inp // per, per) * scale.float()[..., None]).view(rows, inp)


def unpack_int32(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """pack_int32's inverse: int8 values [r, cols]."""
    per = 32 // bits
    u = words.to(torch.int64) & 0xFFFFFFFF
    fields = [(u >> (i * bits)) & ((1 << bits) - 1) for i in range(per)]
    return (torch.stack(fields, -1).view(words.shape[0], -1)[:, :cols] - (1 << (bits - 1))).to(torch.int8)
