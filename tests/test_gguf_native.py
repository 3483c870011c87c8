"""GGUF weights multiplied in place by the native CPU kernels (runtime/kernels/native/gguf_cpu.cpp): each block type
against the `gguf` package's own dequantization followed by a float64 matmul on the same quantized input (the
integer part exact; fp32 across blocks and the bf16 output rounding the only differences), and against the float
input (the input quantization's error, bounded); odd shapes, several rows of x and thread counts, bit-identical
across them; llama.cpp's permuted q/k rows put back in order. End to end: a GGUF model in bfloat16 takes these
kernels (the stats' cpu_kernels) and its logits agree with the dequantized reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from offload_engine.runtime import gguf_dequant
from offload_engine.runtime.kernels import native_build

gguf = pytest.importorskip("gguf")
native = native_build.load() if native_build.supported() is None else None
pytestmark = pytest.mark.skipif(native is None, reason=f"native CPU kernels unavailable: {native_build.why_not()}")

TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4")
# offsets of the fp16 scale fields (sane values: random bytes there would be inf / NaN), MXFP4's exponent byte
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def random_blocks(gtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row bytes] of random valid blocks: random quants, scales of ~1e-2."""
    qt = gguf.GGMLQuantizationType[gtype]
    per, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for at in HALF_FIELDS.get(gtype, ()):
        d = rng.uniform(2e-3, 2e-2, size=(n, k // per)).astype(np.float16)
        raw[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // per, 2)
    if gtype == "MXFP4":
        raw[:, :, 0] = rng.integers(118, 124, size=(n, k // per))
    return raw.reshape(n, -1)


def quantized_input(x: torch.Tensor) -> np.ndarray:
    """x^ (float64) as the kernels quantize a bf16 row per block of 32 (int_input.h): q = rne(x * 127 / amax), r =
    rne((x - q * amax / 127) * 16 * 127 / amax), x^ = (16 q + r) * amax / 127 / 16, in float32 arithmetic."""
    v = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(v).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    step = (amax / np.float32(127)).astype(np.float32)
    q = np.rint(v * inv).astype(np.float32)
    r = np.rint((v - (q * step).astype(np.float32)).astype(np.float32) * (inv * np.float32(16))).astype(np.float32)
    return ((16 * q.astype(np.float64) + r) * (step / np.float32(16)).astype(np.float64)).reshape(x.shape)


def form(raw: np.ndarray, gtype: str, k: int, heads: int = 0) -> list[torch.Tensor]:
    code = int(gguf.GGMLQuantizationType[gtype])
    return [torch.from_numpy(raw.copy()), torch.tensor([code, k, heads], dtype=torch.int64)]


@pytest.mark.parametrize("gtype", TYPES)
# K of 256 / 512 / 1280: Q4_0's four-block path on AVX-512 (gguf_avx512.h); 96 and 160 (3 and 5 blocks): its
# two-block path and Q8_0's with a lone last block
@pytest.mark.parametrize("n,k,m", [(37, 256, 1), (16, 512, 3), (5, 1280, 16), (7, 96, 2), (9, 160, 1)])
def test_kernel_matches_the_gguf_dequantization_on_the_quantized_input(gtype, n, k, m):
    per = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gtype]][0]
    k = max(k // per, 1) * per
    raw = random_blocks(gtype, n, k, seed=n + k)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[gtype]).astype(np.float64)  # [n, k]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    got = native.int_linear(x, form(raw, gtype, k)).float().numpy().astype(np.float64)
    ref = quantized_input(x) @ w.T
    # the integer part exact: what remains is fp32 across blocks (~1e-6 of sum |w x|) and the bf16 output
    bound = 2.0 ** -8 * np.abs(ref) + 1e-5 * (np.abs(quantized_input(x)) @ np.abs(w).T)
    assert np.all(np.abs(got - ref) <= bound), np.abs(got - ref).max()
    # against the float input: the input quantization's error
    exact = x.double().numpy() @ w.T
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < 5e-3, rel


@pytest.mark.parametrize("gtype,k", [("Q8_0", 512), ("Q4_0", 512), ("Q4_0", 480), ("Q4_K", 512), ("Q6_K", 512)])
def test_bits_do_not_depend_on_threads_or_the_rows_beside(gtype, k):
    raw = random_blocks(gtype, 100, k, seed=3)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(native.int_linear(x, form(raw, gtype, k)))
        alone = torch.cat([native.int_linear(x[i:i + 1], form(raw, gtype, k)) for i in range(7)])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs) and torch.equal(alone, outs[0])


def test_permuted_rows_are_put_back_in_order():
    """llama.cpp's q/k rope permutation (heads > 0): the kernel's rows are gguf_dequant.unpermute's."""
    heads, n, k = 4, 32, 256
    raw = random_blocks("Q4_0", n, k, seed=9)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    plain = native.int_linear(x, form(raw, "Q4_0", k))
    permuted = native.int_linear(x, form(raw, "Q4_0", k, heads))
    assert torch.equal(permuted, gguf_dequant.unpermute(plain.t(), heads).t())


def test_bad_forms_are_refused_by_name():
    raw = random_blocks("Q4_0", 4, 64, seed=0)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="do not hold"):
        native.int_linear(x, [torch.from_numpy(raw[:, :30].copy()), torch.tensor([2, 64, 0])])
    with pytest.raises(RuntimeError, match="no native kernel"):
        native.int_linear(x, [torch.from_numpy(raw), torch.tensor([3, 64, 0])])


# ---- end to end ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,preset,gtype", [("qwen3_moe", "tiny", "Q4_0"), ("qwen3_moe", "tiny", "Q8_0"),
                                               ("llama", "tiny", "Q4_0"), ("qwen3", "small", "Q4_K")])
def test_a_gguf_model_computes_in_bf16_on_the_native_kernels(checkpoint_factory, tmp_path, monkeypatch, arch, preset,
                                                             gtype):
    """The file's default compute is bfloat16, every quantized weight multiplied by the native kernels (no weight
    dequantized: gguf_dequant.weight never called; stats' cpu_kernels say so); its logits agree with the
    dequantized float32 reference about as well as the dequantized bfloat16 path's do."""
    from offload_engine import Engine
    from offload_engine.runtime import gguf_dequant as dq
    from tools.gguf_from_hf import write_gguf

    (path,) = write_gguf(checkpoint_factory(arch, preset), tmp_path / f"{gtype}.gguf", gtype)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = {}
    for dtype in ("float32", "bfloat16"):
        with Engine.open(path, dtype=dtype, kernels="dequantize", max_context=64) as engine:
            ref[dtype] = engine.logits(ids)
    dequantized = []
    weight = dq.weight
    monkeypatch.setattr(dq, "weight", lambda *a, **k: dequantized.append(1) or weight(*a, **k))
    with Engine.open(path, max_context=64) as engine:
        assert engine.dtype is torch.bfloat16
        got = engine.logits(ids)
        stats = engine.generate(ids[:8], max_new_tokens=4, ignore_eos=True).stats
    assert not dequantized and stats["cpu_kernels"]["native_gguf"]
    scale = ref["float32"].abs().max()
    err, err_bf16 = ((x - ref["float32"]).abs().max() / scale for x in (got, ref["bfloat16"]))
    print(f"{gtype}: native {err:.3g}, dequantized bf16 {err_bf16:.3g} of max|logit|")
    assert err <= 2 * err_bf16 + 5e-3
