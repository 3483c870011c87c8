"""Load-time fix-ups: where llama.cpp's converter changed a tensor's values or shape, not only its name.

An architecture whose GGUF tensors differ from its schema's beyond names.py's table registers `ArchHooks`
(model.py's ARCH_HOOKS): its own name map, the arguments the file's layout implies (e.g. projections split
differently), and per tensor a `Fixup`, the inverse of the converter's transform. A fix-up runs where a unit's
tensors are built from its bytes (`FixedLayout.views`: the store's slots, resident units and row reads all build
them there), so the bytes read stay the bytes on disk, every budget counts them as stored, and a slot filled
again is fixed again from its fresh bytes (never twice). Only small plain tensors have fix-ups (norm vectors,
per-head constants, conv taps): each makes one new tensor of their size, like the store's dtype casts of plain
tensors, or a view.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..layout import UnitLayout
from .names import gguf_name


@dataclass(frozen=True)
class Fixup:
    what: str  # the converter's transform, for messages
    fix: Callable[[torch.Tensor], torch.Tensor]  # stored tensor -> the schema's tensor
    stored_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None  # schema shape -> stored shape


def minus_one(t: torch.Tensor) -> torch.Tensor:
    """Zero-centred norms stored as 1 + w: w' - 1 is exact for w' in [0.5, inf) (Sterbenz; any w' >= 1), so a
    runtime computing 1 + w gets back the stored w' bit for bit."""
    return t - 1


def log_of_negated(t: torch.Tensor) -> torch.Tensor:
    """A stored as -exp(A_log): A_log = log(-A), computed in float32 (exp(log(x)) returns x within an ulp)."""
    return torch.log(-t.float()).to(t.dtype)


def unsqueeze_middle(t: torch.Tensor) -> torch.Tensor:
    """A depthwise conv's [C, K] taps as the [C, 1, K] weight the schema names (a view: the same bytes)."""
    return t.unsqueeze(1)


def squeeze_middle(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], *shape[2:])


@dataclass(frozen=True)
class ArchHooks:
    """What differs between an architecture's GGUF files and its schema beyond names.py's table."""
    name: Callable[[str], tuple[str, int | None] | None] = gguf_name  # schema name -> (GGUF name, expert)
    fixup: Callable[[str], Fixup | None] = lambda gguf_tensor: None  # by GGUF tensor name
    args: Callable[[Any, Any], Any] = lambda args, g: args  # the naming's args, adjusted to file g's layout
    mtp_name: Callable[[str, int], tuple[str, int | None] | None] | None = None  # (MTP schema name, trunk layers)


DEFAULT_HOOKS = ArchHooks()


@dataclass(frozen=True)
class FixedLayout(UnitLayout):
    """A unit layout whose views of some tensors are passed through their fix-ups."""
    fixes: tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...] = ()

    def views(self, blob: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().views(blob)
        for local, fix in self.fixes:
            out[local] = fix(out[local])
        return out


def with_fixups(layout: UnitLayout, fixups: dict[str, Fixup]) -> UnitLayout:
    """`layout` with the fix-ups of its tensors (keyed by schema name); itself when none has one."""
    fixes = tuple((s.local, fixups[s.tensor].fix) for s in layout.slices if s.tensor in fixups)
    return FixedLayout(layout.key, layout.slices, layout.nbytes, fixes) if fixes else layout
