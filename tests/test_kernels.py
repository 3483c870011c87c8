"""The fast compute paths for quantized weights (runtime/kernels) against dequantize-then-matmul.

Not bit-exact (another summation order; scales and zeros rounded to the compute dtype), so each is held to a
stated tolerance: logits within FP32_TOL x max|logit| in float32 (measured: up to 3e-6), in bfloat16 no further
from the float32 logits than the bfloat16 dequantize path (test_fast_path_in_bfloat16),
greedy tokens identical in float32, and the demo model's held-out perplexity within 1% (tools/quant_kernels.py
runs the full-size check and the speed table). The kernel forms cost the budget nothing beyond what the planner
sized the slots for (written over the stored data, scales in the slot's tail); where they cannot go in place
they are charged to the budget and given back.
"""
from __future__ import annotations

import pytest
import torch

from offload_engine import Budget, Engine
from offload_engine.checkpoint.formats import QuantSpec
from offload_engine.runtime import dequant
from offload_engine.runtime.kernels import cpu_int, select
from offload_engine.store.tier import Prepared
from tools.quant_writers import QuantOptions

PROMPT = list(range(3, 43))
NEW = 8
FP32_TOL, BF16_TOL, BF16_FACTOR = 1e-5, 1e-2, 1.5
REPACKED = Prepared.WHAT


def repacked_bytes(engine: Engine) -> int:
    return sum(a.items.get(REPACKED, 0) for a in engine.store.ledger.accounts.values())


def run(path, kernels: str, dtype: str = "float32", ram=None):
    with Engine.open(path, dtype=dtype, kernels=kernels, budget=Budget(ram=ram),
                     max_context=len(PROMPT) + NEW) as engine:
        logits = engine.logits(PROMPT)
        tokens = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids
        prepared = engine.store.prepared
        return logits, tokens, prepared.built if prepared else 0, prepared


# (arch, quant, options, fast path expected): every mapping cpu_int makes, and formats that stay dequantized
CASES = [
    ("llama", "ct-int4", {}, True), ("qwen3_moe", "ct-int4", {}, True),
    ("llama", "ct-int4", {"symmetric": False}, True), ("llama", "ct-int4", {"strategy": "channel"}, True),
    ("qwen3_5_moe_text", "ct-int4", {}, True),  # fused gate_up experts
    ("deepseek_v3", "ct-int4", {}, True),  # MLA: kv_b_proj read back dense from its kernel form
    ("qwen3_moe", "ct-int8", {}, True), ("llama", "ct-int8", {"symmetric": False}, True),
    ("llama", "ct-int8", {"ct_format": "int-quantized", "symmetric": False}, True),
    ("llama", "gptq", {}, True), ("llama", "gptq", {"bits": 8, "group_size": -1}, True),
    ("llama", "awq", {}, True), ("qwen3_moe", "awq", {}, True),
    # act-order: dequantized, except the experts' down_proj, whose 32 inputs are one group (g_idx all 0: in order)
    ("qwen3_moe", "gptq", {"desc_act": True}, None),
    ("llama", "gptq", {"bits": 8}, False),  # int8 groups: dequantized
    ("llama", "fp8-block", {"block": 16}, True),  # no CPU fp8 kernel: the dense form, made once per fill
    ("qwen3_moe", "fp8-block", {"block": 16}, True),
]


@pytest.mark.parametrize("arch,quant,extra,fast", CASES, ids=lambda v: str(v))
def test_fast_path_matches_dequantize(checkpoint_factory, arch, quant, extra, fast):
    fused = {"fused_experts": True} if arch == "qwen3_5_moe_text" else {}
    path = checkpoint_factory(arch, quant=quant, quant_options=QuantOptions(**extra), **fused)
    ref, ref_tokens, none, _ = run(path, "dequantize")
    got, tokens, built, _ = run(path, "auto")
    assert none == 0
    if fast is not None:
        assert (built > 0) == fast, f"units given kernel forms: {built}"
    scale, diff = ref.abs().max().item(), (got - ref).abs().max().item()
    assert diff <= FP32_TOL * scale, f"max |diff| {diff:.3g} > {FP32_TOL} x max|logit| {scale:.3g}"
    assert tokens == ref_tokens
    if fast is False:
        assert torch.equal(got, ref)  # the same dequantize path, bit for bit


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("quant", ["ct-int4", "ct-int8"])
def test_fast_path_in_bfloat16(checkpoint_factory, quant, arch):
    """bfloat16 rounds either path far from float32 on these small random models (5-35% of max|logit| measured,
    routing flips included), each its own way: the fast path must be no further from the float32 logits than
    the bfloat16 dequantize path, within BF16_FACTOR (+ BF16_TOL of max|logit|)."""
    path = checkpoint_factory(arch, quant=quant)
    exact, _, _, _ = run(path, "dequantize")
    ref, _, _, _ = run(path, "dequantize", dtype="bfloat16")
    got, _, built, _ = run(path, "auto", dtype="bfloat16")
    assert built > 0
    scale = exact.abs().max().item()
    ref_err, err = ((t.float() - exact).abs().max().item() / scale for t in (ref, got))
    assert err <= BF16_FACTOR * ref_err + BF16_TOL, f"fast {err:.3g} vs dequantize {ref_err:.3g} of max|logit|"


@pytest.mark.parametrize("quant", ["ct-int4", "fp8-block"])
def test_kernel_forms_fit_their_slots_under_a_streaming_budget(checkpoint_factory, quant):
    """At 25% the experts stream through slots sized for their kernel forms: every unit takes the kernel (none
    declined for want of budget), written over its stored data with its scales in the slot's tail (nothing
    charged besides), rebuilt from fresh bytes each time a slot is read into again, and the budget holds."""
    path = checkpoint_factory("qwen3_moe", "offload", quant=quant)
    ref, ref_tokens, _, _ = run(path, "dequantize", ram="25%")
    with Engine.open(path, dtype="float32", budget=Budget(ram="25%"), max_context=len(PROMPT) + NEW) as engine:
        got = engine.logits(PROMPT)
        completion = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
        store = engine.store
        held = sum(s.prepared_bytes for t in store.tiers for pool in t.pools.values() for s in pool)
        assert held == repacked_bytes(engine)  # the ledger knows exactly what the slots' forms hold
        stats = completion.stats
        assert stats["peak_bytes"]["host"] <= stats["budget_bytes"]["host"]
        assert store.prepared.declined == 0 and store.prepared.in_place == store.prepared.built > 0
        made = stats["kernel_units"]  # the choice, visible in the request's stats
        assert made["declined"] == 0 and made["in_place"] == made["built"] > 0
        assert held == 0
        assert sum(stats["misses"].values()) > 0  # slots were read into again: forms rebuilt from the new bytes
        ledger = store.ledger
    assert REPACKED not in ledger.accounts["host"].items  # closing gave everything back
    assert (got - ref).abs().max().item() <= FP32_TOL * ref.abs().max().item()
    assert completion.token_ids == ref_tokens


def test_int4_pack_in_uint8_equals_torch_convert():
    """cpu_int's repack (uint8 arithmetic on the stored bytes) is torch's _convert_weight_to_int4pack_for_cpu, bit
    for bit, for whole 64-row blocks and for the tail rows that follow them."""
    gen = torch.Generator().manual_seed(2)
    for n, k in ((64, 256), (128, 64), (48, 64), (16, 32), (80, 64), (208, 96), (1024, 256)):
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        assert torch.equal(cpu_int.int4_pack_bytes(cpu_int.pair_bytes(q)),
                           torch._convert_weight_to_int4pack_for_cpu(q.int(), 1)), (n, k)
        assert torch.equal(cpu_int.int4_nibbles(cpu_int.int4_pack_bytes(cpu_int.pair_bytes(q)), n, k), q)


def test_kernel_forms_read_back_as_the_weight():
    """A weight whose stored data became its kernel form in place is still readable as a dense matrix (dense()
    for the ops that do not multiply it as a linear): the forms' own definitions, unpacked."""
    gen = torch.Generator().manual_seed(1)
    for n, k, g in ((64, 128, 32), (208, 96, 32), (48, 64, 64)):
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        sz = cpu_int.scales_and_zeros(torch.rand(n, k // g, generator=gen), torch.randn(n, k // g, generator=gen),
                                      g, g, torch.float32)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        x = torch.eye(k)
        assert torch.allclose(cpu_int.int4_dense(packed, sz), cpu_int.int4_mm(x, packed, sz).t(), atol=1e-6)
    w8 = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=gen)
    s, t = torch.rand(32, generator=gen), torch.randn(32, generator=gen)
    assert torch.allclose(cpu_int.int8_dense(w8, s, t), cpu_int.int8_mm(torch.eye(64), w8, s, t).t(), atol=1e-5)


def test_dequantize_switch_builds_nothing(checkpoint_factory):
    path = checkpoint_factory("llama", quant="ct-int4")
    _, _, charged, prepared = run(path, "dequantize")
    assert charged == 0 and prepared is None


# ---- the kernels alone -------------------------------------------------------------------------------------
def test_int4_kernel_definition_on_the_cpu():
    """torch's CPU int4 kernel computes x @ ((q - 8) * scale + zero).T per group, as cpu_int relies on."""
    gen = torch.Generator().manual_seed(0)
    n, k, g = 32, 128, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scale, zero = torch.rand(n, k // g, generator=gen) + 0.1, torch.randn(n, k // g, generator=gen)
    x = torch.randn(3, k, generator=gen)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    y = cpu_int.int4_mm(x, packed, cpu_int.scales_and_zeros(scale, zero, g, g, torch.float32))
    w = (q.float() - 8) * scale.repeat_interleave(g, 1) + zero.repeat_interleave(g, 1)
    assert (y - x @ w.t()).abs().max() <= 1e-5 * (x @ w.t()).abs().max()


def test_paths_chosen_per_format_on_the_cpu():
    cpu = torch.device("cpu")
    assert select.path_for(QuantSpec("ct_pack", 64, 128, bits=4, group=32), cpu) == "cpu_int4"
    assert select.path_for(QuantSpec("ct_pack", 64, 128, bits=4, group=16), cpu) is None  # kernel groups >= 32
    assert select.path_for(QuantSpec("ct_pack", 24, 128, bits=4, group=32), cpu) is None  # N % 16
    assert select.path_for(QuantSpec("ct_pack", 64, 128, bits=8, strategy="channel"), cpu) == "cpu_int8"
    assert select.path_for(QuantSpec("ct_pack", 64, 128, bits=8, group=32), cpu) is None
    assert select.path_for(QuantSpec("fp8_block", 64, 128, strategy="block", block=(128, 128)), cpu) == "cpu_dense"
    assert select.path_for(QuantSpec("mxfp4", 64, 128, bits=4, group=32), cpu) is None


# ---- CUDA (skipped without a GPU) ----------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits,symmetric,strategy", [(4, True, "group"), (4, False, "group"), (8, True, "channel"),
                                                     (8, False, "group")])
def test_triton_int_matches_dequantize(bits, symmetric, strategy):
    from offload_engine.runtime.kernels import triton_int

    if not triton_int.available():
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(0)
    n, k, g = 256, 512, 32
    q = QuantSpec("ct_pack", n, k, bits=bits, strategy=strategy, group=g if strategy == "group" else 0,
                  symmetric=symmetric)
    per, groups = 32 // bits, (k // g if strategy == "group" else 1)
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // per), dtype=torch.int32, generator=gen)
    scale = (torch.rand(n, groups, generator=gen) / 50).to(torch.bfloat16)
    zero = None if symmetric else torch.randint(-2**31, 2**31 - 1, (-(-n // per), groups), dtype=torch.int32,
                                                generator=gen)
    dev = torch.device("cuda")
    packed, scale = packed.to(dev), scale.to(dev)
    zero = None if zero is None else zero.to(dev)
    for rows in (1, 4):
        x = torch.randn(rows, k, generator=gen).to(dev, torch.bfloat16)
        ref = x.float() @ dequant.ct_pack(packed, scale, zero, q, torch.float32).t()
        got = triton_int.linear(x, packed, scale, zero, triton_int.meta(q))
        assert got is not None
        assert (got.float() - ref).abs().max() <= BF16_TOL * ref.abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a CUDA device of compute capability 9.0 (Hopper) or later")
@pytest.mark.parametrize("kind", ["fp8_block", "channel"])
def test_scaled_mm_fp8_matches_dequantize(kind):
    from offload_engine.runtime.kernels import fp8

    gen = torch.Generator().manual_seed(0)
    n, k = 256, 512
    dev = torch.device("cuda")
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(dev)
    if kind == "fp8_block":
        q = QuantSpec("fp8_block", n, k, strategy="block", block=(128, 128))
        scale = (torch.rand(n // 128, k // 128, generator=gen) / 1000).to(dev)
        dense = dequant.fp8_block(w, scale, q, torch.float32)
    else:
        q = QuantSpec("ct_naive", n, k, strategy="channel", float_values=True)
        scale = (torch.rand(n, 1, generator=gen) / 1000).to(dev)
        dense = dequant.ct_naive(w, scale, None, q, torch.float32)
    assert fp8.applies(q, dev)
    x = torch.randn(2, k, generator=gen).to(dev, torch.bfloat16)
    got = fp8.linear(x, w, scale, fp8.meta(q))
    assert got is not None, "fp8 _scaled_mm turned itself off (see the log)"
    ref = x.float() @ dense.t()
    assert (got.float() - ref).abs().max() <= 5e-2 * ref.abs().max()  # W8A8: the activations are rounded too


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", ["ct-int4", "ct-int8"])
def test_cuda_engine_fast_path_matches_dequantize(checkpoint_factory, quant):
    path = checkpoint_factory("qwen3_moe", quant=quant)
    out = {}
    for kernels in ("dequantize", "auto"):
        with Engine.open(path, device="cuda", dtype="bfloat16", kernels=kernels,
                         max_context=len(PROMPT) + NEW) as engine:
            out[kernels] = engine.logits(PROMPT).float()
    ref = out["dequantize"]
    assert (out["auto"] - ref).abs().max() <= BF16_TOL * ref.abs().max()


# ---- the perplexity check, small (tools/quant_kernels.py runs it on 20 held-out files) ---------------
@pytest.mark.parametrize("quant", ["ct-int4", "ct-int8"])
def test_demo_model_held_out_perplexity_within_one_percent(tmp_path, quant):
    from tools.quant_kernels import DEMO, held_out_perplexity, quantized_copy

    model = quantized_copy(DEMO, quant, tmp_path / quant, QuantOptions(strategy="channel"))
    ref = held_out_perplexity(model, "dequantize", files=1, windows_per_file=1)
    got = held_out_perplexity(model, "auto", files=1, windows_per_file=1)
    assert got["tokens"] == ref["tokens"] > 100
    assert abs(got["ppl"] / ref["ppl"] - 1) <= 0.01, (got, ref)
