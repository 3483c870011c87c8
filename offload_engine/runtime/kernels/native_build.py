"""The engine's own CPU kernels (native/bf16_cpu.cpp: bfloat16 weights; native/int_cpu.cpp: int8 / int4 kernel
forms; one extension): built once per machine with torch's C++ extension builder, cached, loaded on first use;
absent where they cannot be (no AVX2 / FMA, no C++ compiler), and then the runtime keeps torch's kernels.

Two instruction sets, the best the CPU has (`isa()`): "avx512" (AVX512-BF16, VNNI and VBMI: Sapphire Rapids, Zen 4
and later) and "avx2" (AVX2, FMA and F16C: Haswell, Zen 1-3 and the client CPUs without AVX-512). The sources
pick their inner loops by the compiler's macros (native/*_avx512.h, native/*_avx2.h); everything around them is one
code. A result's bits depend on the instruction set (the sums are formed differently), never on threads or
grouping. OFFLOAD_ENGINE_NATIVE_ISA=avx2 builds the AVX2 kernels on an AVX-512 CPU (to test them there).

The build lands in $OFFLOAD_ENGINE_CACHE (default ~/.cache/offload-engine)/kernels/<torch>-<source hash>/, so a
new torch, another instruction set or a changed source rebuilds and concurrent processes share one build
(torch's builder locks the folder). The first build takes ~1-2 min on 2 cores and is announced on stderr.
OFFLOAD_ENGINE_NATIVE=0 turns the kernels off, =all takes them for every shape unmeasured (kernels/decode.py);
the torch paths are always kept: the parity tests' float32 never uses these, and prefill only where torch has no
native bf16 matmul (the plain bf16 linear, kernels/decode.py ANY_ROWS).
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

from ...interrupts import ending_stray_processes

log = logging.getLogger(__name__)
NATIVE = Path(__file__).with_name("native")
SOURCES = tuple(NATIVE / name for name in ("bf16_cpu.cpp", "int_cpu.cpp", "decode_cpu.cpp", "layer_cpu.cpp",
                                           "decode_plan.cpp", "gguf_cpu.cpp", "bindings.cpp"))
HEADERS = tuple(NATIVE / name for name in ("ops.h", "bf16_util.h", "int_input.h", "bf16_dot_avx512.h",
                                           "bf16_dot_avx2.h", "int_avx512.h", "int_avx2.h", "gguf_blocks.h",
                                           "gguf_avx512.h", "gguf_k_avx512.h"))
# no FMA contraction: an expert's bits must not depend on how the compiler fused one instantiation's arithmetic
# -fopenmp: at::parallel_for is a header template over OpenMP (torch's CPU threading); without the flag it runs
# serially in the extension
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
# per instruction set, best first: the compiler flags and the /proc/cpuinfo flags they need. AVX-512: VPDPBF16PS
# (bf16), VPDPBUSD (VNNI) and VPERMT2B (VBMI), F16C and FMA (the GGUF kernels' 256-bit code: every AVX-512 CPU has
# them); Cooper Lake, the one AVX512-BF16 CPU without VBMI, takes AVX2
ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi", "-mf16c",
               "-mfma"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
ISA_REQUIRED = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512vbmi", "f16c",
                         "fma"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
}
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


def torch_multiplies_bf16() -> bool:
    """Whether torch's own CPU matmul is native bfloat16 here (oneDNN's AVX512-BF16 / AMX path); without it torch
    converts, and the AVX2 kernels take a prefill's rows too (kernels/decode.py ANY_ROWS)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def isa() -> str | None:
    """The instruction set the kernels are built for here: the best one the CPU has, or the one
    OFFLOAD_ENGINE_NATIVE_ISA names where the CPU has it; None where it has none of them."""
    have = cpu_flags()
    wanted = os.environ.get("OFFLOAD_ENGINE_NATIVE_ISA")
    for name, required in ISA_REQUIRED.items():
        if (wanted in (None, "", name)) and required <= have:
            return name
    return None


def flags() -> tuple[str, ...]:
    return BASE_FLAGS + ISA_FLAGS[isa() or "avx2"]


def supported() -> str | None:
    """None where the kernels can run here; otherwise why not."""
    if os.environ.get("OFFLOAD_ENGINE_NATIVE", "1") == "0":
        return "OFFLOAD_ENGINE_NATIVE=0"
    if sys.platform != "linux" or sys.byteorder != "little":
        return f"{sys.platform}: the native kernels are built for x86-64 Linux"
    wanted = os.environ.get("OFFLOAD_ENGINE_NATIVE_ISA")
    if wanted and wanted not in ISA_FLAGS:
        return f"OFFLOAD_ENGINE_NATIVE_ISA={wanted!r} is not one of {', '.join(ISA_FLAGS)}"
    if isa() is None:
        options = [name for name in ISA_FLAGS if wanted in (None, "", name)]
        missing = "; ".join(f"{name} needs {', '.join(sorted(ISA_REQUIRED[name] - cpu_flags()))}" for name in options)
        return f"this CPU lacks the instructions the kernels need ({missing})"
    return None


def build_dir() -> Path:
    base = Path(os.environ.get("OFFLOAD_ENGINE_CACHE", Path.home() / ".cache" / "offload-engine"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(flags()).encode())
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
        print(f"offload-engine: building its {isa()} CPU kernels once into {where} (~1-2 min)", file=sys.stderr)
    with ending_stray_processes():  # a Ctrl-C mid-build: ninja is killed outright, its compilers would run on
        return cpp_extension.load(name="offload_engine_cpu", sources=[str(p) for p in SOURCES],
                                  build_directory=str(where), extra_cflags=list(flags()), extra_ldflags=["-fopenmp"],
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
