"""The native int8 / int4 CPU kernels (runtime/kernels/native/int_cpu.cpp, int_experts.py): against
dequantize-then-matmul in float32 on the input as they quantize it and torch's weight-only kernels, an expert's bits independent of grouping and
threads, and ct-int8 / ct-int4 bf16 engines whose decode takes them giving the same bits at every budget."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload_engine import Budget, Engine
from offload_engine.runtime.kernels import cpu_int, decode, int_experts, native_build

native = native_build.load()
pytestmark = pytest.mark.skipif(native is None, reason=f"native kernels unavailable: {native_build.why_not()}")
BF16_TOL, BF16_FACTOR = 1e-2, 1.5  # tests/test_kernels.py: the bf16 fast path against the bf16 dequantize path


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).abs().max() / ref.abs().max()).item()


def int8_form(n: int, k: int, g: torch.Generator, term: bool = False) -> list[torch.Tensor]:
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s = (torch.rand(n, generator=g) / 50 + 1e-3).bfloat16()
    return [q, s] + ([(torch.randn(n, generator=g) / 20).bfloat16()] if term else [])


def int4_form(n: int, k: int, g: torch.Generator, group: int = 32) -> list[torch.Tensor]:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    sz = cpu_int.scales_and_zeros(torch.rand(n, k // group, generator=g) / 50 + 1e-3,
                                  torch.randn(n, k // group, generator=g) / 50, group, group, torch.bfloat16)
    return [cpu_int.int4_pack_bytes(cpu_int.pair_bytes(q)), sz]


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels quantize it, dequantized, float32: per block of 32, q = round(x * 127 / amax) and the rest
    in sixteenths of a step, r = round((x - q * amax / 127) * 16 * 127 / amax), x^ = (16 q + r) * amax / 2032
    (round: to nearest even)."""
    m, k = x.shape
    blocks = F.pad(x.float(), (0, -k % 32)).view(m, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)  # a division (127 / t is reciprocal * 127)
    step = amax / 127
    q = torch.round(blocks * inv)
    r = torch.round((blocks - q * step) * (inv * 16))
    return ((16 * q + r) * (step / 16)).view(m, -1)[:, :k]


def dense(form: list[torch.Tensor]) -> torch.Tensor:
    if form[0].dtype == torch.uint8:
        return cpu_int.int4_dense(form[0], form[1])
    return cpu_int.int8_dense(form[0], form[1], form[2] if len(form) > 2 else None)


# int8: rows in and out of 4-row tiles, K off the 16 lanes, a zero term; int4: 64-row blocks, the N % 64 rows
# after them (16, 32, 48), groups of 32..256, rows of x in and out of pairs
CASES = [("int8", 1, 64, 64, {}), ("int8", 3, 304, 1000, {"term": True}), ("int8", 17, 48, 33, {}),
         ("int8", 5, 23, 16, {"term": True}), ("int4", 1, 64, 128, {}), ("int4", 3, 80, 256, {"group": 64}),
         ("int4", 5, 208, 96, {}), ("int4", 2, 112, 512, {"group": 256}), ("int4", 16, 48, 64, {}),
         ("int4", 1, 256, 1024, {"group": 128})]


@pytest.mark.parametrize("kind,m,n,k,extra", CASES, ids=str)
def test_linear_matches_dequantize_then_matmul(kind: str, m: int, n: int, k: int, extra: dict) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    form = (int8_form if kind == "int8" else int4_form)(n, k, g, **extra)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = dense(form)
    ref = F.linear(quantized(x), w)
    ours = native.int_linear(x, form)
    assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
    # the quantized input's product: fp32 sums rounded once to bf16, within one bf16 rounding of the float32
    # product (and its sums' fp32 error)
    assert (ours.float() - ref).abs().le(ref.abs() * 2 ** -8 + ref.abs().max() * 1e-5).all()
    # against the bf16 input itself: within the quantization's own bound, sum_k |W[n, k]| |x_k - x^_k|
    exact = F.linear(x.float(), w)
    bound = F.linear((x.float() - quantized(x)).abs(), w.abs())
    assert (ours.float() - exact).abs().le(bound + exact.abs() * 2 ** -8 + exact.abs().max() * 1e-5).all()


def _experts(count: int, hidden: int, inter: int, kinds: tuple[str, ...], seed: int = 0, fused: bool = False):
    g = torch.Generator().manual_seed(seed)
    make = {"int8": lambda n, k: int8_form(n, k, g, term=True), "int4": lambda n, k: int4_form(n, k, g)}
    xs = [torch.randn(1 + e % 3, hidden, generator=g).bfloat16() for e in range(count)]
    gates, ups, downs = [], [], []
    for e in range(count):
        kind = kinds[e % len(kinds)]
        gates.append(make[kind](2 * inter if fused else inter, hidden))
        ups.append([] if fused else make[kind](inter, hidden))
        downs.append(make[kind](hidden, inter))
    return xs, gates, ups, downs, [torch.rand(x.shape[0], generator=g).bfloat16() for x in xs]


@pytest.mark.parametrize("fused", [False, True])
def test_experts_match_the_torch_path(fused: bool) -> None:
    xs, gates, ups, downs, ws = _experts(6, 128, 64, ("int8", "int4"), fused=fused)
    ours = native.experts_int(xs, gates, ups, downs, ws)
    for e in range(6):
        mm = int_experts.torch_mm
        gate, up = mm(xs[e], gates[e]).chunk(2, dim=-1) if fused else (mm(xs[e], gates[e]), mm(xs[e], ups[e]))
        torch_bf16 = mm(F.silu(gate) * up, downs[e]) * ws[e][:, None]
        wg = dense(gates[e])
        wgate, wup = wg.chunk(2) if fused else (wg, dense(ups[e]))
        x = xs[e].float()
        ref = F.linear(F.silu(F.linear(x, wgate)) * F.linear(x, wup), dense(downs[e])) * ws[e][:, None].float()
        # each projection in float32 on the input it quantizes (x, then h made as the kernel makes it, in bf16):
        # ours is then bf16 rounding away, as torch's bf16 path is from the float32 one
        h = F.silu(F.linear(quantized(xs[e]), wgate).bfloat16()) * F.linear(quantized(xs[e]), wup).bfloat16()
        ref_q8 = F.linear(quantized(h), dense(downs[e])) * ws[e][:, None].float()
        assert rel(ours[e], ref_q8) <= 2 * max(rel(torch_bf16, ref), 2 ** -8), e
        assert rel(ours[e], torch_bf16.float()) <= 2 ** -5, e  # torch's weight-only kernels: within 3%


def test_an_experts_bits_do_not_depend_on_its_company_or_threads() -> None:
    xs, gates, ups, downs, ws = _experts(6, 128, 96, ("int4", "int8"), seed=1)  # 96: a 64-row block and 32 rows after
    together = native.experts_int(xs, gates, ups, downs, ws)
    linear = [native.int_linear(xs[e], gates[e]) for e in range(6)]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for e in range(6):
                alone = native.experts_int([xs[e]], [gates[e]], [ups[e]], [downs[e]], [ws[e]])[0]
                assert torch.equal(alone, together[e]), (threads, e)
                assert torch.equal(native.int_linear(xs[e], gates[e]), linear[e]), (threads, e)
    finally:
        torch.set_num_threads(before)


def test_the_scratch_kept_between_calls_changes_no_bits() -> None:
    """run_experts_int keeps its inputs' quantized digits and outputs in the calling thread's scratch: a call after
    others of other shapes (fused forms, more rows, the same x shared by every expert as in a decode step, rows
    enough to free the scratch) gives the bits of the first."""
    xs, gates, ups, downs, ws = _experts(4, 128, 64, ("int4", "int8"), seed=3)
    first = native.experts_int(xs, gates, ups, downs, ws)
    row = xs[0][:1].contiguous()
    moe = native.moe_row(row, row, torch.ones(4).bfloat16(), [3, 2, 1, 0], gates, ups, downs, None)
    native.experts_int(*_experts(6, 128, 96, ("int8", "int4"), seed=4, fused=True))
    native.experts_int([row] * 4, gates, ups, downs, [torch.ones(1).bfloat16()] * 4)
    many = torch.randn(300, 128).bfloat16()  # over kKeptRows: the scratch is freed after it
    native.experts_int([many], gates[:1], ups[:1], downs[:1], [torch.ones(300).bfloat16()])
    assert all(torch.equal(a, b) for a, b in zip(first, native.experts_int(xs, gates, ups, downs, ws)))
    assert torch.equal(moe, native.moe_row(row, row, torch.ones(4).bfloat16(), [3, 2, 1, 0], gates, ups, downs,
                                           None))


def test_int_linears_are_each_int_linear_bit_for_bit() -> None:
    """One call for an attention's q, k and v (x quantized once per group size): each the bits alone."""
    g = torch.Generator().manual_seed(5)
    forms = [int8_form(64, 128, g), int4_form(64, 128, g), int8_form(48, 128, g, term=True), int4_form(16, 128, g, 64)]
    for rows in (1, 3):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        together = native.int_linears(x, forms)
        assert all(torch.equal(y, native.int_linear(x, f)) for y, f in zip(together, forms))


def test_bad_input_is_refused_by_name() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="columns"):
        native.int_linear(x, int8_form(16, 32, g))
    with pytest.raises(RuntimeError, match="scales must be bfloat16"):
        native.int_linear(x, [int8_form(16, 64, g)[0], torch.rand(16)])
    xs, gates, ups, downs, ws = _experts(1, 64, 32, ("int8",))
    with pytest.raises(RuntimeError, match="do not chain"):
        native.experts_int(xs, gates, ups, [int8_form(64, 16, g)], ws)


def test_int_choice_is_measured_then_recalled(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OFFLOAD_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv("OFFLOAD_ENGINE_NATIVE", raising=False)
    first = decode.choose(set(), None, ("int4-g32", 128, 64, 2), {("int8", 64, 128)})
    assert set(first.timings) == {"experts-int4-g32:128x64x2", "int8:64x128"}
    assert all(t["torch_us"] > 0 and t["native_us"] > 0 for t in first.timings.values())
    again = decode.choose(set(), None, ("int4-g32", 128, 64, 2), {("int8", 64, 128)})
    assert again.timings == first.timings and again.experts == first.experts  # the stored choice, not re-timed
    assert again.native_int == first.native_int


@pytest.mark.parametrize("arch,quant,extra", [("qwen3_moe", "ct-int8", {}), ("qwen3_moe", "ct-int4", {}),
                                              ("qwen3_5_moe_text", "ct-int4", {"fused_experts": True})], ids=str)
def test_int_engine_on_native_kernels_is_budget_invariant(arch: str, quant: str, extra: dict, checkpoint_factory,
                                                          monkeypatch) -> None:
    """Decode takes the native int kernels; the resident experts of a layer go in one call and the rest one by
    one as they land, so a 25% budget groups them differently from 100%: the bits must not move. Against torch's
    kernels (OFFLOAD_ENGINE_NATIVE=0): no further from the float32 logits. (The two do not agree to bf16 rounding:
    the native kernels quantize their inputs to 12 bits per 32 values, a projection's output within ~0.3% as
    torch's bf16 kernels are, but other bits, which this small random model amplifies from layer to layer, to
    ~25-35% of the logits for either.)"""
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "all")
    path = checkpoint_factory(arch, "offload", dtype="bfloat16", quant=quant, **extra)
    ids = list(range(3, 15))
    runs = {}
    for ram in (None, "25%"):
        with Engine.open(path, budget=Budget(ram=ram), max_context=64) as engine:
            assert engine.dtype == torch.bfloat16 and engine.model.kernels is not None
            completion = engine.generate(ids, max_new_tokens=12, ignore_eos=True)
            chosen = completion.stats["cpu_kernels"]
            assert chosen["native_experts"] and chosen["native_int_linear"]  # experts and attention
            assert engine.store.prepared.built > 0
            runs[ram] = (engine.logits(ids), completion.token_ids, completion.stats["bytes_read_disk"])
    (full, tokens, _), (budgeted, budget_tokens, read) = runs[None], runs["25%"]
    assert read > 0  # the 25% run streamed experts
    assert torch.equal(full, budgeted) and tokens == budget_tokens
    monkeypatch.setenv("OFFLOAD_ENGINE_NATIVE", "0")
    with Engine.open(path, max_context=64) as engine:  # torch's weight-only kernels
        assert engine.model.kernels is None
        theirs = engine.logits(ids)
    with Engine.open(path, dtype="float32", kernels="dequantize", max_context=64) as engine:
        exact = engine.logits(ids)
    scale = exact.abs().max().item()
    ours_err, theirs_err = ((t.float() - exact).abs().max().item() / scale for t in (full, theirs))
    assert ours_err <= BF16_FACTOR * theirs_err + BF16_TOL, f"native {ours_err:.3g} vs torch {theirs_err:.3g}"
