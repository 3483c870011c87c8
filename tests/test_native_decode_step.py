"""The native steps around a decode step's matmuls (runtime/kernels/native/decode_cpu.cpp): one query's attention
(QK-norm, RoPE, cache write, GQA attention) against the torch path, and the experts' combine plus the residual
bit for bit; a bf16 engine taking them against torch's bf16 path."""
from __future__ import annotations

import pytest
import torch

from offload_engine import Budget, Engine
from offload_engine.runtime.kernels import native_build
from offload_engine.runtime.layers import apply_rotary, attention, rms_norm
from offload_engine.runtime.moe import combine

native = native_build.load()
needs_native = pytest.mark.skipif(native is None, reason=f"native kernels unavailable: {native_build.why_not()}")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@needs_native
@pytest.mark.parametrize("heads,kv_heads,dim,start,qk_norm", [(16, 4, 64, 37, True), (4, 4, 32, 0, False),
                                                              (6, 2, 128, 200, True)])
def test_attend_one_matches_the_torch_path(heads: int, kv_heads: int, dim: int, start: int, qk_norm: bool) -> None:
    g = torch.Generator().manual_seed(heads * dim + start)
    def t(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).bfloat16()
    q, k, v = t(1, heads * dim, s=2), t(1, kv_heads * dim, s=2), t(1, kv_heads * dim)
    qn, kn = (t(dim, s=0.3) + 1, t(dim, s=0.3) + 1) if qk_norm else (None, None)
    angles = torch.randn(1, dim // 2, generator=g) * 3
    cos, sin = torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16()
    k_cache, v_cache = t(start + 8, kv_heads, dim), t(start + 8, kv_heads, dim)
    theirs_k, theirs_v = k_cache.clone(), v_cache.clone()

    qh, kh = q.view(1, heads, dim), k.view(1, kv_heads, dim)
    if qk_norm:
        qh, kh = rms_norm(qh, qn, 1e-6), rms_norm(kh, kn, 1e-6)
    qh, kh = apply_rotary(qh, cos, sin), apply_rotary(kh, cos, sin)
    theirs_k[start], theirs_v[start] = kh[0], v.view(kv_heads, dim)
    mask = torch.ones(1, start + 1, dtype=torch.bool)
    theirs = attention(qh, theirs_k[:start + 1], theirs_v[:start + 1], mask, dim ** -0.5)
    ref = attention(qh.float(), theirs_k[:start + 1].float(), theirs_v[:start + 1].float(), mask, dim ** -0.5)

    ours = native.attend_one(q, k, v, qn, kn, 1e-6, cos, sin, k_cache, v_cache, start, dim ** -0.5)
    assert torch.equal(v_cache, theirs_v)  # the value written as given, nothing else touched
    assert torch.equal(k_cache[:start], theirs_k[:start]) and torch.equal(k_cache[start + 1:], theirs_k[start + 1:])
    assert rel(k_cache[start], theirs_k[start]) <= 2 ** -7  # the key normed and roped: within a bf16 rounding
    assert rel(ours, ref) <= 2 * max(rel(theirs, ref), 2 ** -8)


@needs_native
def test_attend_one_refuses_bad_shapes_by_name() -> None:
    q, kv = torch.zeros(1, 64).bfloat16(), torch.zeros(1, 32).bfloat16()
    cache = torch.zeros(4, 1, 32).bfloat16()
    cs = torch.zeros(1, 32).bfloat16()
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.attend_one(q, kv, kv, None, None, 1e-6, cs, cs, cache, cache.clone(), 4, 1.0)
    with pytest.raises(RuntimeError, match="k: expected 32 values"):
        native.attend_one(q, q, kv, None, None, 1e-6, cs, cs, cache, cache.clone(), 0, 1.0)


@needs_native
@pytest.mark.parametrize("count,shared", [(8, False), (3, True), (0, False)])
def test_combine_add_is_the_torch_sum_bit_for_bit(count: int, shared: bool) -> None:
    g = torch.Generator().manual_seed(count)
    x = (torch.randn(1, 512, generator=g) * 4).bfloat16()
    parts = {e: (None, (torch.randn(1, 512, generator=g) * 10 ** (e % 3 - 1)).bfloat16()) for e in range(count)}
    extra = torch.randn(1, 512, generator=g).bfloat16() if shared else None
    out = combine(x, parts)
    theirs = x + (out if extra is None else out + extra)
    ours = native.combine_add(x, [parts[e][1] for e in sorted(parts)], extra)
    assert torch.equal(ours, theirs)


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_rms_norm_rows_is_within_a_bf16_rounding_of_the_torch_norm(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = (torch.randn(rows, 1000, generator=g) * 3).bfloat16(), torch.randn(1000, generator=g).bfloat16()
    ours, theirs = native.rms_norm_rows(x, w, 1e-6), rms_norm(x, w, 1e-6)
    # the sum of squares in another order: an element may round to the neighbouring bf16 value, no further
    assert (ours.float() - theirs.float()).abs().le(theirs.float().abs() * 2 ** -7).all()
    assert (ours == theirs).float().mean() > 0.99
    with pytest.raises(RuntimeError, match="norm weight"):
        native.rms_norm_rows(x, w[:999], 1e-6)
    with pytest.raises(RuntimeError, match="rows, hidden"):
        native.rms_norm_rows(x[0], w, 1e-6)


@needs_native
@pytest.mark.parametrize("arch,budget", [("qwen3_moe", "25%"), ("qwen2_moe", "25%"), ("llama", "1MiB")])
def test_engine_decode_steps_take_the_native_attention(arch: str, budget: str, checkpoint_factory,
                                                       monkeypatch) -> None:
    """A bf16 engine's one-token steps go through attend_one (QK-norm for Qwen3, biases for Qwen2, GQA): the
    same greedy tokens and logits to bf16 rounding as torch's bf16 path, and the same bits resident and streamed."""
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "all")
    path = checkpoint_factory(arch, "offload", dtype="bfloat16")
    ids = list(range(3, 11))
    calls = []
    runs = {}
    for ram in (None, budget):
        with Engine.open(path, budget=Budget(ram=ram), max_context=64) as engine:
            for name in ("attend_one", "attention_block"):  # alone, or within the layer's attention block
                real = getattr(native, name)
                monkeypatch.setattr(engine.model.kernels.module, name,
                                    lambda *a, real=real: calls.append(1) or real(*a), raising=False)
            runs[ram] = engine.generate(ids, max_new_tokens=10, ignore_eos=True)
    assert calls  # the decode steps took it
    assert runs[None].token_ids == runs[budget].token_ids
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "0")
    with Engine.open(path, max_context=64) as engine:
        assert engine.model.kernels is None
        theirs = engine.generate(ids, max_new_tokens=10, ignore_eos=True)
    agree = sum(a == b for a, b in zip(runs[None].token_ids, theirs.token_ids))
    assert agree >= len(theirs.token_ids) - 2  # bf16 rounding may flip a near-tie late in the sequence


@needs_native
def test_native_parts_of_a_few_rows_take_their_routing_views_bit_for_bit() -> None:
    """native_parts over a verification's few rows: with moe.RowRouting (consecutive rows as views) the experts'
    parts and their sum are the general path's (torch.where and gathers) bit for bit."""
    from types import SimpleNamespace

    from offload_engine.runtime.moe import RowRouting, native_parts

    g = torch.Generator().manual_seed(3)
    H, I, E, k = 256, 128, 8, 2
    mats = {e: tuple((torch.randn(*s, generator=g) * 0.05).bfloat16() for s in ((I, H), (I, H), (H, I)))
            for e in range(E)}
    kernels = SimpleNamespace(module=native)
    for T in (2, 3, 5, 9, 16):
        x = torch.randn(T, H, generator=g).bfloat16()
        base = torch.randperm(E, generator=g)[:k]
        indices = torch.stack([base if t % 3 else torch.randperm(E, generator=g)[:k] for t in range(T)])
        weights = torch.softmax(torch.randn(T, k, generator=g), -1).bfloat16()
        routing = RowRouting(indices, weights)
        experts = [(e, mats[e]) for e in routing.order]
        fast = native_parts(kernels, x, indices, weights, experts, routing)
        general = native_parts(kernels, x, indices, weights, experts)
        for e in routing.order:
            assert torch.equal(fast[e][1], general[e][1]), (T, e)
        assert torch.equal(combine(x, fast), combine(x, general)), T
