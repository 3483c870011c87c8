"""Shared fixtures: small real checkpoints written by tools/make_checkpoint.py (transformers' own classes)."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.make_checkpoint import make_checkpoint  # noqa: E402

# The budget tests describe the CPU tiers: there `ram` bounds the compute tier, while on CUDA the default VRAM budget
# is the free device memory, so a ram-only budget would hold the whole model. Engines opened without a device run
# on the CPU unless the runner sets OFFLOAD_ENGINE_DEVICE; tests/test_cuda.py opens its engines on cuda itself.
os.environ.setdefault("OFFLOAD_ENGINE_DEVICE", "cpu")

ARCHS = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen3_next",
         "qwen3_5_moe_text")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Test models are tiny: on a 2-core CI box shared with the reader threads, extra intra-op threads mostly
    spin (a small matmul ran ~200x slower with 2 threads under load). One thread for the whole suite."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory) -> Callable[..., Path]:
    """checkpoint_factory(arch, preset="tiny", **options) -> folder, built once per session per options."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("checkpoints")

    def build(arch: str, preset: str = "tiny", **options) -> Path:
        key = (arch, preset, tuple(sorted(options.items())))
        if key not in cache:
            name = "-".join([arch, preset] + [f"{k}={v}" for k, v in sorted(options.items())])
            if len(name) > 120:  # a dataclass option's repr grows with its fields: past NAME_MAX once written
                name = f"{arch}-{preset}-{hashlib.sha1(name.encode()).hexdigest()[:16]}"
            cache[key] = make_checkpoint(arch, preset, root / name, **options)
        return cache[key]

    return build
