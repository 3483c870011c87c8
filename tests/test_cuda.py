"""The CUDA paths on a GPU (skipped elsewhere; tools/gpu_check.py runs them): device slots in VRAM, pinned host
slots, the copy stream, GPUDirect reads when kvikio is installed, and the ledger against the CUDA allocator.

On CUDA the tiers are VRAM (device), pinned RAM (host) and the checkpoint (disk), so every budget here names both."""
from __future__ import annotations

import threading

import pytest
import torch

from offload_engine import Budget, Engine, PrefetchConfig
from offload_engine.errors import IOFault

from tests.test_prefetch import SlowReads
from tests.test_store import CONTEXT, NEW, PROMPT, Faulty

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def run(path, **open_kw):
    with Engine.open(path, device="cuda", dtype="float32", max_context=CONTEXT, **open_kw) as engine:
        logits = engine.logits(PROMPT)
        completion = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
        return logits, completion, engine.store.gds is not None


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "deepseek_v3"])
def cuda_reference(request, checkpoint_factory):
    path = checkpoint_factory(request.param, "offload")
    logits, completion, _ = run(path)  # fully resident in VRAM
    return path, logits, completion


@pytest.mark.parametrize("gds", ["auto", "off"])
@pytest.mark.parametrize("vram,ram", [("10%", "40%"), ("25%", "40%"), ("50%", "40%"), ("10%", "100%")])
def test_vram_budgets_match_resident(cuda_reference, monkeypatch, vram, ram, gds):
    """VRAM + pinned RAM + disk at every VRAM budget, with and without GPUDirect: bitwise the resident logits."""
    monkeypatch.setenv("OFFLOAD_ENGINE_GDS", gds)
    path, ref_logits, ref = cuda_reference
    logits, completion, used_gds = run(path, budget=Budget(vram=vram, ram=ram))
    assert torch.equal(logits, ref_logits)
    assert completion.token_ids == ref.token_ids
    stats = completion.stats
    for tier in ("device", "host"):
        assert stats["peak_bytes"][tier] <= stats["budget_bytes"][tier]
    assert stats["misses"]["device"] > 0
    if ram == "100%":  # the host was filled at open: misses in VRAM are served by pinned copies, GDS or not
        assert stats["hits"]["host"] > 0 and stats["bytes_host_to_device"] > 0 and stats["bytes_read_disk"] == 0
    else:
        assert stats["bytes_read_disk"] > 0
    if gds == "off":
        assert not used_gds


def test_device_allocations_stay_within_the_vram_budget(checkpoint_factory):
    """The ledger's device bytes are real CUDA allocations: what the allocator holds while generating stays
    within the VRAM budget plus activations (a few MiB for these models)."""
    path = checkpoint_factory("qwen3_moe", "offload")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    with Engine.open(path, budget=Budget(vram="25%", ram="40%"), device="cuda", dtype="float32",
                     max_context=CONTEXT) as engine:
        completion = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
        budget = completion.stats["budget_bytes"]["device"]
        peak = torch.cuda.max_memory_allocated() - before
        # what the allocator took from the card: one allocation per pool, so segment rounding adds <= 2 MiB each
        reserved = torch.cuda.max_memory_reserved() - reserved_before
    assert peak <= budget + 8 * 2**20, f"CUDA peak {peak} bytes over a device budget of {budget}"
    assert reserved <= budget + 32 * 2**20, f"CUDA reserved {reserved} bytes for a device budget of {budget}"
    assert completion.stats["peak_bytes"]["device"] <= budget


def test_pinned_host_pools_are_the_bytes_charged(checkpoint_factory):
    """The host tier's pools are page-locked in place (cudaHostRegister), not by torch's pinned allocator,
    which rounds each allocation up to a power of two: the process grows by the host budget, not up to twice it."""
    import psutil

    path = checkpoint_factory("qwen3_moe", "medium")
    torch.zeros(1, device="cuda")  # the CUDA context exists before the baseline
    process = psutil.Process()
    before = process.memory_info().rss
    with Engine.open(path, budget=Budget(vram="10%", ram="60%"), device="cuda", dtype="float32",
                     max_context=CONTEXT) as engine:
        grown = process.memory_info().rss - before
        host = engine.store.ledger.budgets()["host"]
        assert engine.store.host.unpin, "the host pools were not page-locked"
    assert grown <= host + 64 * 2**20, f"RSS grew {grown} bytes for a host budget of {host}"


@pytest.mark.parametrize("mode", ["eio", "short"])
def test_read_fault_on_the_host_bounce_path_surfaces_and_the_engine_recovers(checkpoint_factory, mode):
    """A read_fn replaces the disk read (and so turns GPUDirect off): the fault names the shard, the engine
    recovers, and the copy stream leaves no half-copied unit behind."""
    path = checkpoint_factory("qwen3_moe", "offload")
    _, ref, _ = run(path)
    baseline = threading.active_count()
    faulty = Faulty(fail_at=None, mode=mode)
    engine = Engine.open(path, budget=Budget(vram="10%", ram="40%"), device="cuda", dtype="float32",
                         max_context=CONTEXT, direct_io="off", read_fn=faulty)
    assert engine.store.gds is None
    faulty.fail_at = faulty.calls + 5
    with pytest.raises(IOFault) as err:
        engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True)
    assert ".safetensors" in str(err.value) and "offset" in str(err.value)
    faulty.fail_at = None
    assert engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids == ref.token_ids
    engine.close()
    assert threading.active_count() == baseline


def test_route_ahead_prefetch_on_cuda_is_lossless(cuda_reference):
    """Route ahead without the pay check: a layer waiting for disk reads (slowed, as from a slow drive: reads of
    these small checkpoints otherwise land before anyone waits) predicts the next layers' experts and reads them
    ahead; their copies land on the copy stream while the compute stream runs."""
    path, ref_logits, ref = cuda_reference
    # VRAM 25%: at 10% deepseek_v3's device tier has no expert slot to spare for a read ahead (measured on CPU)
    _, completion, _ = run(path, budget=Budget(vram="25%", ram="40%"), direct_io="off", read_fn=SlowReads(0.003),
                           prefetch=PrefetchConfig(adaptive=False, reads=0, route_ahead=2))
    assert completion.token_ids == ref.token_ids
    assert completion.stats["expert_reads"]["ahead"] > 0


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_host_compute_on_cuda_gives_the_resident_tokens(cuda_reference, mode):
    """Experts held in pinned RAM are computed by the CPU (another summation order than the GPU's: the logits
    agree to rounding, the greedy tokens exactly on these models). auto measures the rates at open and decides
    per expert; on takes every one."""
    path, ref_logits, ref = cuda_reference
    logits, completion, _ = run(path, budget=Budget(vram="10%", ram="100%"), host_compute=mode)
    assert completion.token_ids == ref.token_ids
    assert torch.allclose(logits, ref_logits, atol=1e-4 * ref_logits.abs().max().item())
    if mode == "on":
        assert completion.stats["host_computed"] > 0 and completion.stats["bytes_host_to_device"] == 0
