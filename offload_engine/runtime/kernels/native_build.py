"""The engine's own CPU kernels (native/bf16_cpu.cpp: bfloat16 weights; native/int_cpu.cpp: int8 / int4 kernel
forms; one extension): built once per machine with torch's C++ extension builder, cached, loaded on first use;
absent where they cannot be (no AVX512-BF16, no C++ compiler), and then the runtime keeps torch's kernels.

The build lands in $OFFLOAD_ENGINE_CACHE (default ~/.cache/offload-engine)/kernels/<torch>-<source hash>/, so a
new torch or a changed source rebuilds and concurrent processes share one build (torch's builder locks the
folder). The first build takes ~1-2 min on 2 cores and is announced on stderr. OFFLOAD_ENGINE_NATIVE=0 turns the
kernels off, =all takes them for every shape unmeasured (kernels/decode.py); the torch paths are always kept:
prefill and the parity tests' float32 never use these.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
NATIVE = Path(__file__).with_name("native")
SOURCES = tuple(NATIVE / name for name in ("bf16_cpu.cpp", "int_cpu.cpp", "decode_cpu.cpp", "bindings.cpp"))
HEADERS = (NATIVE / "bf16_util.h", NATIVE / "int_input.h")
# no FMA contraction: an expert's bits must not depend on how the compiler fused one instantiation's arithmetic
# -fopenmp: at::parallel_for is a header template over OpenMP (torch's CPU threading); without the flag it runs
# serially in the extension
FLAGS = ("-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni",
         "-mavx512vbmi", "-fopenmp")
# int_cpu.cpp's VPDPBUSD (VNNI) and VPERMT2B (VBMI): Sapphire Rapids and Zen 4 on have them all; Cooper Lake,
# the one AVX512-BF16 CPU without VBMI, falls back to torch's kernels
REQUIRED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512vbmi"})
STALE_LOCK_S = 900  # a build takes 1-2 min on 2 cores
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_why_not: list[str] = []


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported() -> str | None:
    """None where the kernels can run here; otherwise why not."""
    if os.environ.get("OFFLOAD_ENGINE_NATIVE", "1") == "0":
        return "OFFLOAD_ENGINE_NATIVE=0"
    if sys.platform != "linux" or sys.byteorder != "little":
        return f"{sys.platform}: the native kernels are built for x86-64 Linux"
    missing = REQUIRED_FLAGS - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    return None


def build_dir() -> Path:
    base = Path(os.environ.get("OFFLOAD_ENGINE_CACHE", Path.home() / ".cache" / "offload-engine"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(FLAGS).encode())
    digest = digest.hexdigest()[:12]
    return base / "kernels" / f"torch-{torch.__version__.split('+')[0]}-{digest}"


def load() -> ModuleType | None:
    """The compiled kernels, or None (the reason: `why_not()`). Built at most once per process."""
    with _lock:
        if "bf16" in _loaded:
            return _loaded["bf16"]
        module = None
        reason = supported()
        if reason is None:
            try:
                module = _build()
            except Exception as failure:  # no compiler, no ninja, a toolchain without AVX512-BF16 ...
                reason = f"build failed ({type(failure).__name__}: {str(failure).strip().splitlines()[-1:]})"
        if reason is not None:
            _why_not.append(reason)
            log.info("native CPU kernels off: %s", reason)
        _loaded["bf16"] = module
        return module


def why_not() -> str | None:
    return _why_not[-1] if _why_not else None


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    try:  # the `ninja` wheel's binary, for a venv that is not activated (torch's builder looks on PATH)
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(where / "lock")
    fresh = not any(where.glob("*.so"))
    if fresh:
        print(f"offload-engine: building its CPU kernels once into {where} (~1-2 min)", file=sys.stderr)
    return cpp_extension.load(name="offload_engine_cpu", sources=[str(p) for p in SOURCES],
                              build_directory=str(where), extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                              verbose=False)


def _clear_stale_lock(lock: Path) -> None:
    """torch's builder makes other processes wait, without end, while its lock file exists; a build killed
    outright (SIGKILL, power) leaves it behind. A lock older than any build takes is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)
