"""--kv-dtype auto|bf16|fp8|int8 (runtime/kv_storage.py): auto stores the entries as given (today's cache); fp8 and
int8 quantize each position's row (a KV head's K or V, MLA's latent or rope key) on its own with one fp32 scale.

Tolerances on the demo model (DeepSeek-V3-style MLA + MoE, fp32 compute on CPU), per position
err = max|logits - logits_auto| / max|logits_auto|: the median over positions within 5e-3 (int8; measured ~2e-3) and
2.5e-2 (fp8; measured ~1e-2). The maximum is not bounded tightly: a near-tied router flips an expert at a position
or two (the worst measured: int8 8e-2, fp8 2.2e-1; a bf16 cache flips them too, 4.6e-2). The greedy choices along
a 64-token continuation agree in >= 95% of positions (teacher-forced; measured int8 100%, fp8 97-100%) and int8's
free-running 64 tokens are identical."""
from __future__ import annotations

import json

import pytest
import torch

from offload_engine import ConfigError, Engine
from offload_engine.assemble import SPEC_ROOM
from offload_engine.cli import build_parser, main
from offload_engine.frontend.engine_flags import engine_config
from offload_engine.config import EngineConfig
from offload_engine.defaults import default_model_path
from offload_engine.planner import kv
from offload_engine.checkpoint.hf_config import parse_config
from offload_engine.planner.plan import PlanOptions, load_model_spec, model_shape, plan
from offload_engine.runtime.kv_cache import KVCache

from test_planner import CPU, GPU

PROMPT = "The history of the printing press begins with"
NEW = 64
QUANTIZED = ("int8", "fp8")
MEDIAN_TOL = {"bf16": 2e-3, "int8": 5e-3, "fp8": 2.5e-2}


@pytest.fixture(scope="module")
def engines():
    opened = {k: Engine.open(default_model_path(), kv_dtype=k, max_context=256) for k in ("auto", "bf16", *QUANTIZED)}
    yield opened
    for engine in opened.values():
        engine.close()


# ---- the storage ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_keeps_the_entries_as_given_and_reads_views(dtype):
    cache = KVCache(2, 16)
    k, v = torch.randn(5, 2, 8, dtype=dtype), torch.randn(5, 2, 8, dtype=dtype)
    k_all, v_all = cache.append(1, k, v)
    assert k_all.dtype == dtype and torch.equal(k_all, k) and torch.equal(v_all, v)
    cache.advance(5)
    k2, _ = cache.append(1, k[:1], v[:1])
    assert k2.data_ptr() == k_all.data_ptr() and torch.equal(k2[:5], k)  # views of one buffer: no copy, no cast
    assert cache.nbytes == 2 * 16 * 2 * 8 * k.element_size()


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_rows_are_quantized_each_on_its_own(kv_dtype):
    torch.manual_seed(0)
    x = torch.randn(12, 3, 16) * torch.logspace(-3, 2, 12)[:, None, None]  # rows of very different scales
    x[4, 1] = 0  # an all-zero row stays exactly zero
    whole, pieces = KVCache(1, 12, kv_dtype=kv_dtype), KVCache(1, 12, kv_dtype=kv_dtype)
    (read,) = whole.append(0, x)
    for a, b in ((0, 5), (5, 6), (6, 12)):  # the same rows written in chunks: the same bytes
        (got,) = pieces.append(0, x[a:b])
        pieces.advance(b - a)
    assert torch.equal(got, read) and read.dtype == x.dtype
    absmax = x.abs().amax(-1, keepdim=True)
    step = absmax / 127 / 2 if kv_dtype == "int8" else torch.maximum(x.abs() / 16, absmax / 448 * 2 ** -9)
    assert bool(((read - x).abs() <= step * (1 + 1e-5)).all())
    assert bool((read[4, 1] == 0).all())
    assert whole.nbytes == 12 * kv.layer_kv_bytes_per_token(_spec(3, 16), 4, kv_dtype) // 2  # one tensor of K/V


@pytest.mark.parametrize("kv_dtype", ("auto", "bf16", *QUANTIZED))
def test_keep_and_trim_move_data_and_scales_together(kv_dtype):
    torch.manual_seed(1)
    x = torch.randn(10, 2, 8) * torch.arange(1, 11)[:, None, None]
    cache, fresh = KVCache(1, 10, kv_dtype=kv_dtype), KVCache(1, 10, kv_dtype=kv_dtype)
    cache.append(0, x)
    cache.advance(10)
    cache.keep([3, 5, 8])  # a speculative path: positions 0-2 committed, 3 the root, 5 and 8 accepted
    cache.trim(1)
    (kept,) = cache.append(0, x[9:])
    (expected,) = fresh.append(0, x[[0, 1, 2, 3, 5, 9]])
    assert torch.equal(kept, expected)


def _spec(heads: int, head_dim: int):
    """A one-layer Llama config with `heads` KV heads of `head_dim`."""
    return parse_config({"model_type": "llama", "num_key_value_heads": heads, "head_dim": head_dim,
                         "num_attention_heads": heads, "hidden_size": heads * head_dim, "num_hidden_layers": 1,
                         "vocab_size": 8, "intermediate_size": 8})


# ---- the demo model -----------------------------------------------------------------------------------------------
def test_auto_is_the_default_and_bf16_under_bf16_compute_is_auto():
    ids = list(range(3, 40))
    with Engine.open(default_model_path(), dtype="bfloat16", max_context=64) as auto, \
            Engine.open(default_model_path(), dtype="bfloat16", max_context=64, kv_dtype="bf16") as bf16:
        assert torch.equal(auto.logits(ids), bf16.logits(ids))
    assert EngineConfig().kv_dtype == "auto"


@pytest.mark.parametrize("kv_dtype", ("bf16", *QUANTIZED))
def test_logits_and_greedy_choices_stay_close_to_the_full_precision_cache(engines, kv_dtype):
    reference = engines["auto"].generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids
    ids = engines["auto"].tokenizer.encode(PROMPT) + reference
    full, got = engines["auto"].logits(ids), engines[kv_dtype].logits(ids)
    err = (got - full).abs().amax(-1) / full.abs().amax(-1)
    assert err.median() <= MEDIAN_TOL[kv_dtype], err
    generated = slice(len(ids) - NEW - 1, -1)  # the rows whose argmax chose each generated token
    agree = (got[generated].argmax(-1) == full[generated].argmax(-1)).float().mean()
    assert agree >= 0.95, agree
    if kv_dtype != "fp8":
        assert engines[kv_dtype].generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids == reference


def test_under_bf16_compute_the_quantized_cache_adds_little_to_bf16_s_own_error():
    """What a GPU runs: bf16 compute (here on the CPU). Against the fp32 engine, bf16 compute moves the median
    position's logits by ~7.6e-3 of max|logit|; an int8 cache on top by no more (measured 6.8e-3), fp8 ~1.2e-2."""
    ids = list(range(3, 60))
    with Engine.open(default_model_path(), max_context=128) as engine:
        full = engine.logits(ids)
    err = {}
    for kv_dtype in ("auto", *QUANTIZED):
        with Engine.open(default_model_path(), max_context=128, dtype="bfloat16", kv_dtype=kv_dtype) as engine:
            err[kv_dtype] = ((engine.logits(ids) - full).abs().amax(-1) / full.abs().amax(-1)).median()
    assert err["int8"] <= 1.5 * err["auto"] and err["fp8"] <= 3 * err["auto"], err


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_speculative_decoding_is_lossless_with_the_same_kv_dtype(kv_dtype):
    with Engine.open(default_model_path(), kv_dtype=kv_dtype, max_context=256, spec="mtp") as engine:
        reference = engine.generate(PROMPT, max_new_tokens=32, ignore_eos=True, spec="off").token_ids
        for mode in ("mtp", "ngram", "self"):
            out = engine.generate(PROMPT, max_new_tokens=32, ignore_eos=True, spec=mode, spec_depth=3, spec_width=2)
            assert out.token_ids == reference, mode
            assert out.stats["spec_steps"] > 0
    # a draft model is an engine of its own: its caches use the same storage
    with Engine.open(default_model_path(), kv_dtype=kv_dtype, max_context=256, spec="draft",
                     draft_model=default_model_path(), spec_depth=3, spec_width=1) as engine:
        assert engine.draft.model.kv_dtype == kv_dtype
        assert engine.generate(PROMPT, max_new_tokens=32, ignore_eos=True).token_ids == reference


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_chunked_prefill_stores_what_one_forward_stores(engines, kv_dtype):
    model, ids = engines[kv_dtype].model, torch.arange(3, 67)
    chunk = model.prefill_chunk
    try:
        model.prefill_chunk = 64
        whole_cache = model.new_cache(65)
        whole = model.forward(ids, whole_cache)
        model.prefill_chunk = 24
        chunked_cache = model.new_cache(65)
        chunked = model.forward(ids, chunked_cache)
    finally:
        model.prefill_chunk = chunk
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4 * whole.abs().max().item())
    nxt = torch.tensor([70])  # the caches hold the same entries: the next position reads them alike
    torch.testing.assert_close(model.forward(nxt, chunked_cache), model.forward(nxt, whole_cache), rtol=1e-4,
                               atol=1e-4 * whole.abs().max().item())


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_mla_reads_the_quantized_latent_alike_on_both_paths(engines, kv_dtype):
    """MLA attends either through kv_b_proj-expanded K/V or in latent space (absorbed): both read the same
    dequantized latent and rope key."""
    model, ids = engines[kv_dtype].model, torch.arange(3, 40)
    chosen = model.ops.absorb
    try:
        rows = {}
        for absorb in (True, False):
            model.ops.absorb = absorb
            rows[absorb] = model.forward(ids, model.new_cache(len(ids)))
    finally:
        model.ops.absorb = chosen
    torch.testing.assert_close(rows[True], rows[False], rtol=1e-4, atol=1e-4 * rows[False].abs().max().item())


def test_prefix_cache_reuse_gives_a_fresh_prefill_s_tokens(engines):
    first = PROMPT + " a"
    engine = engines["int8"]
    engine.generate(first, max_new_tokens=8, ignore_eos=True)  # leaves its cache for the next prompt to extend
    reused = engine.generate(first + " single", max_new_tokens=16, ignore_eos=True)
    assert reused.stats["reused_prompt_tokens"] > 0
    with Engine.open(default_model_path(), kv_dtype="int8", max_context=256) as fresh:
        assert fresh.generate(first + " single", max_new_tokens=16, ignore_eos=True).token_ids == reused.token_ids


# ---- other attention layouts --------------------------------------------------------------------------------------
# the tiny random checkpoints amplify any perturbation of the cache (a bf16 cache moves gpt-oss's logits by 1.4% of
# max|logit| at the median position, llama's by 0.8%, qwen3_next's by 0.02%): there the check is that int8 and fp8
# move them by what their precision says relative to bf16 (about 4x and 16x: measured int8 2.6-6.3x, fp8 12-30x),
# not by a wrong scale or a misplaced position (which would be O(1))
NOISE_VS_BF16 = {"int8": 8, "fp8": 40}


@pytest.mark.parametrize("arch", ["qwen3_next", "gpt_oss", "llama"])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_hybrid_sliding_and_dense_layers(checkpoint_factory, arch, kv_dtype):
    """qwen3_next: full-attention layers quantized, the DeltaNet state in the compute dtype; gpt_oss: the sliding
    layers' window over a quantized cache. Speculative self-drafting stays lossless through the hybrid's state
    rewind and gpt-oss's window; llama: plain K/V, no router."""
    path = checkpoint_factory(arch, "offload")
    ids = list(range(3, 51))
    with Engine.open(path, max_context=128) as auto, Engine.open(path, max_context=128, kv_dtype="bf16") as bf16, \
            Engine.open(path, max_context=128, kv_dtype=kv_dtype) as q:
        full = auto.logits(ids)
        err = {k: ((e.logits(ids) - full).abs().amax(-1) / full.abs().amax(-1)).median() for k, e in
               (("bf16", bf16), (kv_dtype, q))}
        assert err[kv_dtype] <= NOISE_VS_BF16[kv_dtype] * err["bf16"], err
        cache = q.model.new_cache(len(ids))
        q.model.forward(torch.tensor(ids), cache)
        if arch == "qwen3_next":
            linear = next(layer for layer in range(q.model.num_layers) if cache.state(layer) is not None)
            assert all(t.dtype == torch.float32 for t in cache.state(linear))
        plain = q.generate(ids, max_new_tokens=12, ignore_eos=True, spec="off").token_ids
        spec = "ngram" if arch == "llama" else "self"  # self-drafting needs routed experts
        assert q.generate(ids, max_new_tokens=12, ignore_eos=True, spec=spec, spec_depth=3,
                          spec_width=1).token_ids == plain


# ---- plan and ledger ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ("auto", "bf16", *QUANTIZED))
def test_the_engine_charges_and_allocates_what_the_plan_predicts(kv_dtype):
    context = 100
    with Engine.open(default_model_path(), kv_dtype=kv_dtype, max_context=context) as engine:
        charged = sum(t.kv_bytes for t in engine.placement.tiers)
        predicted = plan(model_shape(engine.model.spec), CPU, PlanOptions(context=context + SPEC_ROOM,
                                                                          kv_dtype=kv_dtype)).kv_bytes
        assert charged == predicted
        cache = engine.model.new_cache(context)
        engine.model.forward(torch.arange(3, 10), cache)
        assert cache.nbytes == kv.kv_bytes(engine.model.spec, context, 4, kv_dtype=kv_dtype)


@pytest.mark.parametrize("model", ["DeepSeek-V3", "Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "gpt-oss-120b", "demo"])
def test_quantized_positions_cost_about_half_of_bf16(model):
    """One byte per value and a 4-byte scale per row: (row + 4) / (2 row) of bf16 (DeepSeek's 512 + 64: 50.7%,
    Qwen's heads of 128: 51.6%, gpt-oss's of 64: 53.1%, the demo's 48 + 16: 56.3%), half that of the fp32 cache a
    CPU engine keeps."""
    spec = load_model_spec(str(default_model_path()) if model == "demo" else model)
    per = {k: kv.kv_bytes_per_position(spec, 4, k) for k in ("auto", "bf16", *QUANTIZED)}
    for k in QUANTIZED:
        assert per[k] <= 0.57 * per["bf16"] and 2 * per[k] <= 0.57 * per["auto"], per


def test_the_plan_charges_the_dequantized_copy_and_its_traffic():
    """Attention reads a compute-dtype copy of a quantized cache: the plan counts it in the activations (one layer
    at a time) and in the bytes a step moves, so int8's attention never looks cheaper than bf16's. The step as a
    whole may be faster: the smaller cache leaves VRAM to cache experts in, and fewer cross PCIe."""
    shape, context = model_shape(load_model_spec("Qwen3-30B-A3B")), 32768
    auto, int8 = (plan(shape, GPU, PlanOptions(context=context, kv_dtype=k)) for k in ("auto", "int8"))
    assert int8.kv_bytes == kv.kv_bytes(shape.spec, context, 2, kv_dtype="int8") < 0.52 * auto.kv_bytes
    copy = kv.kv_copy_bytes(shape.spec, context, 2, "int8")
    assert sum(int8.activations.values()) - sum(auto.activations.values()) == copy > 0
    quantized, plain = int8.steps["expected"], auto.steps["expected"]
    assert quantized.compute_s > plain.compute_s  # the same weights, and the cache read twice over
    assert quantized.bytes_h2d < plain.bytes_h2d  # the VRAM the cache gave back holds experts
    assert kv.kv_copy_bytes(shape.spec, context, 2, "auto") == kv.kv_copy_bytes(shape.spec, context, 2, "bf16") == 0
    cache = KVCache(1, 64, kv_dtype="int8")  # the copy as the cache makes it: K and V in the compute dtype
    k_all, v_all = cache.append(0, torch.randn(64, 4, 128), torch.randn(64, 4, 128))
    one_layer = kv.kv_copy_bytes(_spec(4, 128), 64, 4, "int8")
    assert k_all.nbytes + v_all.nbytes + k_all.nbytes == one_layer  # and the fp32 product of one of them


# ---- flags --------------------------------------------------------------------------------------------------------
def test_a_bad_kv_dtype_is_refused_naming_the_flag(capsys):
    for bad in ("q8_0", "float8", None):
        with pytest.raises(ConfigError, match="--kv-dtype"):
            EngineConfig(kv_dtype=bad)
    with pytest.raises(ConfigError, match="--kv-dtype"):
        Engine.open(default_model_path(), kv_dtype="int4")
    with pytest.raises(ConfigError, match="--kv-dtype"):
        KVCache(1, 4, kv_dtype="int4")
    with pytest.raises(ConfigError, match="--kv-dtype"):
        plan(model_shape(_spec(2, 8)), CPU, PlanOptions(kv_dtype="int4"))
    for command in (["run", "--prompt", "x"], ["plan", "--model", str(default_model_path())]):
        with pytest.raises(SystemExit) as exit_:
            main(command + ["--kv-dtype", "q4"])
        assert exit_.value.code == 2 and "--kv-dtype" in capsys.readouterr().err


def test_run_serve_and_plan_take_the_flag(capsys):
    for command in ("run", "serve"):
        extra = ["--prompt", "x"] if command == "run" else []
        assert engine_config(build_parser().parse_args([command, "--kv-dtype", "fp8", *extra])).kv_dtype == "fp8"
    assert main(["run", "--prompt", "Hello", "--max-new-tokens", "4", "--kv-dtype", "int8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 4 and out["stats"]["kv_dtype"] == "int8"
    assert main(["run", "--prompt", "Hello", "--max-new-tokens", "2", "--kv-dtype", "fp8", "--stats"]) == 0
    assert "KV fp8" in capsys.readouterr().err
    assert main(["plan", "--model", str(default_model_path()), "--kv-dtype", "int8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_dtype"] == "int8" and out["kv_bytes_per_position"] == 4 * (48 + 4 + 16 + 4)  # 4 MLA layers


# ---- on a GPU (skipped elsewhere) ---------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_on_cuda_in_bf16(kv_dtype):
    """What a GPU user runs: bf16 compute, the quantized cache in VRAM, charged at its size (itemsize 2)."""
    ids = list(range(3, 60))
    with Engine.open(default_model_path(), device="cpu", max_context=128) as engine:
        full = engine.logits(ids)
    err = {}
    for kv_dtype_ in ("auto", kv_dtype):
        with Engine.open(default_model_path(), device="cuda", dtype="bfloat16", max_context=128,
                         kv_dtype=kv_dtype_) as engine:
            err[kv_dtype_] = ((engine.logits(ids) - full).abs().amax(-1) / full.abs().amax(-1)).median()
            cache = engine.model.new_cache(64)
            engine.model.forward(torch.tensor(ids[:8]), cache)
            assert cache.nbytes == kv.kv_bytes(engine.model.spec, 64, 2, kv_dtype=kv_dtype_)
            plain = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True).token_ids
            assert engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True, spec="ngram").token_ids == plain
    assert err[kv_dtype] <= (1.5 if kv_dtype == "int8" else 3) * err["auto"], err
