"""Frozen option dataclasses. `from_dict` rejects unknown keys so a typo in a preset is an error, not a no-op."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .errors import ConfigError
from .units import parse_bytes

ByteSize = int | str | None


def _from_dict(cls, data: Mapping[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown option(s) {unknown}; known: {sorted(names)}")
    return cls(**data)


@dataclass(frozen=True)
class Budget:
    """Hard byte budgets per tier. Values: int bytes, or strings like '512MiB', '12GiB', '1.5GB', '25%' (of the
    model's bytes). None means: not limited by the user (the device tier then defaults to what the device has)."""

    vram: ByteSize = None
    ram: ByteSize = None

    from_dict = classmethod(_from_dict)

    def resolve(self, model_bytes: int) -> "ResolvedBudget":
        def one(value: ByteSize, flag: str) -> int | None:
            if value is None:
                return None
            try:
                return parse_bytes(value, what=flag, total=model_bytes)
            except ValueError as e:
                raise ConfigError(str(e)) from None

        return ResolvedBudget(device=one(self.vram, "--vram"), host=one(self.ram, "--ram"))


@dataclass(frozen=True)
class ResolvedBudget:
    device: int | None
    host: int | None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Compute dtype: float32 on CPU, bfloat16 on CUDA unless asked otherwise."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None: OFFLOAD_ENGINE_DEVICE if set (the test suite sets 'cpu'), else cuda when available, else cpu."""
    source = "--device"  # what an error names
    if device is None and os.environ.get("OFFLOAD_ENGINE_DEVICE"):
        device, source = os.environ["OFFLOAD_ENGINE_DEVICE"], "OFFLOAD_ENGINE_DEVICE"
    elif device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{source} {device!r} is not a device (expected 'cpu', 'cuda' or 'cuda:N')") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{source} {device!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{source} {device!r} is not supported (expected 'cpu' or 'cuda')")
    return dev
