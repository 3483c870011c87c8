"""The engine's own bf16 CPU decode kernels (runtime/kernels/native/bf16_cpu.cpp, decode.py): against float32
references and torch's bf16 path, an expert's bits independent of grouping and threads, and a bf16 engine whose
decode takes them giving the same bits at every budget."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload_engine import Budget, Engine
from offload_engine.runtime.kernels import decode, native_build

native = native_build.load()
needs_native = pytest.mark.skipif(native is None, reason=f"native kernels unavailable: {native_build.why_not()}")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).abs().max() / ref.abs().max()).item()


@needs_native
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (3, 300, 1000), (16, 48, 96), (17, 40, 33), (1, 7, 5)])
def test_linear_matches_float32_like_torch_bf16(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float())
    ours = native.linear(x, w)
    assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
    # both round the fp32 sum once to bf16: within one bf16 rounding of the float32 product
    assert (ours.float() - ref).abs().le(ref.abs() * 2 ** -8 + 1e-6).all()
    assert rel(ours, ref) <= 2 * max(rel(F.linear(x, w), ref), 2 ** -9)


def _experts(count: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    def t(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).bfloat16()
    xs = [t(1 + e % 3, hidden) * 10 for e in range(count)]
    return (xs, [t(inter, hidden) for _ in range(count)], [t(inter, hidden) for _ in range(count)],
            [t(hidden, inter) for _ in range(count)], [torch.rand(x.shape[0], generator=g).bfloat16() for x in xs])


@needs_native
def test_experts_match_the_torch_path() -> None:
    xs, gates, ups, downs, ws = _experts(5, 96, 40)
    ours = native.experts(xs, gates, ups, downs, ws)
    for e in range(5):
        torch_bf16 = F.linear(F.silu(F.linear(xs[e], gates[e])) * F.linear(xs[e], ups[e]), downs[e]) * ws[e][:, None]
        ref = F.linear(F.silu(F.linear(xs[e].float(), gates[e].float())) * F.linear(xs[e].float(), ups[e].float()),
                       downs[e].float()) * ws[e][:, None].float()
        assert rel(ours[e], ref) <= 2 * max(rel(torch_bf16, ref), 2 ** -8), e


@needs_native
def test_an_experts_bits_do_not_depend_on_its_company_or_threads() -> None:
    xs, gates, ups, downs, ws = _experts(6, 64, 32, seed=1)
    together = native.experts(xs, gates, ups, downs, ws)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for e in range(6):
                alone = native.experts([xs[e]], [gates[e]], [ups[e]], [downs[e]], [ws[e]])[0]
                assert torch.equal(alone, together[e]), (threads, e)
    finally:
        torch.set_num_threads(before)


@needs_native
def test_bad_input_is_refused_by_name() -> None:
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="weight: expected a CPU bfloat16"):
        native.linear(x, torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="columns"):
        native.linear(x, torch.randn(8, 32).bfloat16())
    xs, gates, ups, downs, ws = _experts(1, 64, 32)
    with pytest.raises(RuntimeError, match="do not chain"):
        native.experts(xs, gates, ups, [downs[0][:, :16].contiguous()], ws)


@needs_native
def test_choices_are_measured_then_recalled(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OFFLOAD_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv("OFFLOAD_ENGINE_NATIVE", raising=False)
    first = decode.choose({(64, 128)}, (128, 64, 2))
    assert set(first.timings) == {"64x128", "experts:128x64x2"}
    assert all(t["torch_us"] > 0 and t["native_us"] > 0 for t in first.timings.values())
    again = decode.choose({(64, 128)}, (128, 64, 2))
    assert again.timings == first.timings and again.native == first.native  # the stored choice, not re-timed
    assert (tmp_path / "kernels" / "choices.json").is_file()


@needs_native
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_bf16_engine_on_native_kernels_is_budget_invariant(arch: str, checkpoint_factory, monkeypatch) -> None:
    """Decode (<= 16 rows) takes the native kernels; the resident experts of a layer go in one call and the
    rest one by one as they land, so a 25% budget groups them differently from 100%: the bits must not move."""
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "all")
    path = checkpoint_factory(arch, "offload", dtype="bfloat16")
    ids = list(range(3, 15))
    runs = {}
    for ram in (None, "25%"):
        with Engine.open(path, budget=Budget(ram=ram), max_context=64) as engine:
            assert engine.dtype == torch.bfloat16 and engine.model.kernels is not None
            completion = engine.generate(ids, max_new_tokens=12, ignore_eos=True)
            assert completion.stats["cpu_kernels"]["native_experts"]
            runs[ram] = (engine.logits(ids), completion.token_ids, completion.stats["bytes_read_disk"])
    (full, tokens, _), (budgeted, budget_tokens, read) = runs[None], runs["25%"]
    assert read > 0  # the 25% run streamed experts
    assert torch.equal(full, budgeted) and tokens == budget_tokens
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "0")
    with Engine.open(path, max_context=64) as engine:  # torch's bf16 path: the same model to bf16 rounding
        assert engine.model.kernels is None
        theirs = engine.logits(ids)
    assert rel(full, theirs) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1024), (3, 16, 64), (48, 96)])
def test_rms_norm_equals_the_spelled_out_form(dtype, shape) -> None:
    """runtime/layers.rms_norm takes F.rms_norm for transformers' six-op form: the bits must not change."""
    from offload_engine.runtime.layers import rms_norm

    g = torch.Generator().manual_seed(sum(shape))
    x, w = (torch.randn(*shape, generator=g) * 3).to(dtype), torch.randn(shape[-1], generator=g).to(dtype)
    h = x.to(torch.float32)
    spelled = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), spelled)


@needs_native
def test_linears_are_each_linear_bit_for_bit() -> None:
    """One call for an attention's q, k and v (kernels/decode.py DecodeKernels.linears): each the bits alone."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, 96, generator=g).bfloat16() for n in (64, 16, 16, 40)]
    for rows in (1, 5):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        together = native.linears(x, weights)
        assert all(torch.equal(y, native.linear(x, w)) for y, w in zip(together, weights))
    with pytest.raises(RuntimeError, match="weight 1"):
        native.linears(x, [weights[0], torch.randn(8, 95).bfloat16()])


@needs_native
def test_a_prefills_rows_each_get_a_decode_steps_bits() -> None:
    """Where torch has no native bf16 matmul (AVX2), the plain linear takes any number of rows (a prefill's,
    [batch, tokens, in]): each row's output is the bits the same row gets alone in a decode step, within a bf16
    rounding of float32; elsewhere prefill stays with torch (more than MAX_ROWS rows: None)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 40, 200, generator=g).bfloat16(), torch.randn(72, 200, generator=g).bfloat16()
    anywhere = decode.DecodeKernels(native, frozenset({(72, 200)}), False, {}, frozenset(), decode.ANY_ROWS)
    y = anywhere.linear(x, w)
    assert y.shape == (1, 40, 72) and y.dtype == torch.bfloat16
    for t in range(40):
        assert torch.equal(y[0, t], native.linear(x[0, t:t + 1].contiguous(), w)[0]), t
    ref = F.linear(x.float(), w.float())
    assert (y.float() - ref).abs().le(ref.abs() * 2 ** -8 + 1e-6).all()
    decode_only = decode.DecodeKernels(native, frozenset({(72, 200)}), False, {}, frozenset())
    assert decode_only.linear(x, w) is None and decode_only.linear(x[0, :16], w) is not None
    chosen = decode.choose({(72, 200)}, None)
    assert chosen.plain_rows == (decode.MAX_ROWS if native_build.torch_multiplies_bf16() else decode.ANY_ROWS)
    assert chosen.describe()["isa"] == native_build.isa()
