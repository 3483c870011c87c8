"""The device and compute dtype an engine runs on, resolved from EngineConfig's names (config.py checks their form)
against this machine when the engine is assembled: whether CUDA is there, whether its CPU multiplies bf16 well."""
from __future__ import annotations

import os

import torch

from ..config import DTYPE_NAMES
from ..errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert tuple(DTYPES) == DTYPE_NAMES  # --dtype's choices (config.DTYPE_NAMES) are these


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, stored: str | None = None) -> torch.dtype:
    """Compute dtype, unless asked: bfloat16 on CUDA; on a CPU the checkpoint's own (`stored`, config.json's
    dtype) where it is bfloat16 and the CPU multiplies bfloat16 well (cpu_computes_bf16: 4-5x the float32 decode
    speed on such a checkpoint, docs/PERF.md), else float32 (what the parity tests use)."""
    if dtype is None:
        if device.type == "cuda" or (stored == "bfloat16" and cpu_computes_bf16()):
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def cpu_computes_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 well: torch natively (oneDNN's AVX512-BF16 / AMX), or the engine's own
    kernels (AVX2 and up: runtime/kernels/native_build.py, built on first use, which prefill takes too where torch
    lacks the former). Without either, torch converts: slower than float32."""
    from .kernels import native_build  # (built on first use)

    return native_build.torch_multiplies_bf16() or native_build.load() is not None


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
