"""Which instruction set the native CPU kernels are built for (runtime/kernels/native_build.py): the best the CPU
has, AVX-512 or AVX2, overridable for testing, each in its own cached build; a clear reason where neither fits.
The kernels themselves are tested in test_native_*kernels.py on whichever build this machine takes; the last test
here makes sure that build loads (a compile error would otherwise only skip them)."""
from __future__ import annotations

import shutil

import pytest

from offload_engine.runtime.kernels import native_build

AVX2 = {"avx2", "fma", "f16c", "sse2"}
AVX512 = AVX2 | native_build.ISA_REQUIRED["avx512"]


@pytest.fixture
def cpu(monkeypatch):
    def have(flags: set[str]) -> None:
        monkeypatch.setattr(native_build, "cpu_flags", lambda: set(flags))
    monkeypatch.delenv("OFFLOAD_ENGINE_NATIVE_ISA", raising=False)
    monkeypatch.delenv("OFFLOAD_ENGINE_NATIVE", raising=False)
    return have


def test_the_best_instruction_set_the_cpu_has(cpu) -> None:
    cpu(AVX512)
    assert native_build.isa() == "avx512" and "-mavx512bf16" in native_build.flags()
    cpu(AVX512 - {"avx512vbmi"})  # Cooper Lake: AVX512-BF16 without VBMI
    assert native_build.isa() == "avx2" and "-mavx2" in native_build.flags()
    assert not any(flag.startswith("-mavx512") for flag in native_build.flags())
    cpu(AVX2)
    assert native_build.isa() == "avx2" and native_build.supported() is None


def test_avx2_can_be_forced_on_an_avx512_cpu_and_builds_apart(cpu, monkeypatch) -> None:
    cpu(AVX512)
    best = native_build.build_dir()
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE_ISA", "avx2")
    assert native_build.isa() == "avx2" and native_build.build_dir() != best
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE_ISA", "avx512")
    cpu(AVX2)  # asked for what the CPU lacks: no kernels, and the reason names the missing flags
    assert native_build.isa() is None
    assert "avx512 needs" in native_build.supported() and "avx512_bf16" in native_build.supported()


def test_reasons_name_what_is_missing(cpu, monkeypatch) -> None:
    cpu({"sse2"})
    reason = native_build.supported()
    assert reason is not None and "avx2 needs avx2, f16c, fma" in reason
    cpu(AVX2)
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE_ISA", "neon")
    assert "OFFLOAD_ENGINE_NATIVE_ISA='neon' is not one of avx512, avx2" in native_build.supported()
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "0")
    assert native_build.supported() == "OFFLOAD_ENGINE_NATIVE=0"


def test_the_kernels_build_where_the_cpu_takes_them() -> None:
    """A compile error in the sources must fail the suite, not turn every native test into a skip (the engine
    then runs on torch's kernels, correct and several times slower). Only a missing toolchain may skip here."""
    if native_build.supported() is not None:
        pytest.skip(f"no native build on this machine: {native_build.supported()}")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    assert native_build.load() is not None, native_build.why_not()
