"""store.hostmem: the huge-page host regions that CPU slot pools live in."""
from __future__ import annotations

import errno
import gc
import mmap

import pytest
import torch

from offload_engine.store import hostmem
from offload_engine.store.hostmem import HUGE_PAGE, host_buffer


def test_region_is_aligned_writable_and_outlives_its_mapping_object():
    n = 3 * HUGE_PAGE + 12345
    buf = host_buffer(n)
    assert buf.dtype == torch.uint8 and buf.numel() == n and buf.device.type == "cpu"
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert buf.data_ptr() % HUGE_PAGE == 0
    tail = buf[-4096:]
    del buf
    gc.collect()
    tail.fill_(7)  # the mapping lives as long as any view of it
    assert int(tail.sum()) == 7 * 4096


def test_small_buffers_come_from_torch():
    assert host_buffer(4096).numel() == 4096


def test_no_memory_is_an_out_of_memory_error(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    monkeypatch.setattr(hostmem.mmap, "mmap", refuse)
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this OS: host_buffer is torch.empty")
    with pytest.raises(torch.OutOfMemoryError, match=str(HUGE_PAGE * 4)):
        host_buffer(HUGE_PAGE * 4)


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("populate_advice", ["kernel", "refused"])
def test_a_region_is_faulted_in_when_made(monkeypatch, populate_advice):
    """Its pages are resident before first use (a direct read must not fault them in on the reader's path), and
    only the bytes asked for: where the kernel refuses MADV_POPULATE_WRITE (EINVAL before Linux 5.14), a byte per
    page is written instead."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this OS: host_buffer is torch.empty")
    if populate_advice == "refused":
        monkeypatch.setattr(hostmem, "MADV_POPULATE_WRITE", -1)  # an advice no kernel knows: EINVAL
    n = 32 * HUGE_PAGE + 12345
    gc.collect()
    before = _rss()
    buf = host_buffer(n)
    grown = _rss() - before
    assert n - HUGE_PAGE <= grown <= n + 4 * HUGE_PAGE, (grown, n)
    assert int(buf[::hostmem.PAGE].sum()) == 0  # anonymous memory reads as zeros either way


def test_no_memory_to_fault_in_is_an_out_of_memory_error(monkeypatch):
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this OS: host_buffer is torch.empty")

    class Overcommitted(mmap.mmap):  # the mapping succeeds, faulting its pages in finds no memory
        def madvise(self, option, *args):
            if option == hostmem.MADV_POPULATE_WRITE:
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            return super().madvise(option, *args)
    monkeypatch.setattr(hostmem.mmap, "mmap", Overcommitted)
    with pytest.raises(torch.OutOfMemoryError, match="fault in"):
        host_buffer(HUGE_PAGE * 4)


def test_each_cpu_slot_pool_is_one_region(checkpoint_factory):
    """A CPU tier's pool of a kind is one region sliced into slots, whether it caches (a budget) or pins
    every unit (none)."""
    from offload_engine import Budget, Engine

    path = checkpoint_factory("qwen3_moe", "offload")
    for budget in (Budget(ram="25%"), None):
        with Engine.open(path, budget=budget, max_context=64, direct_io="off") as engine:
            for pool in engine.store.compute.pools.values():
                size = pool[0].blob.numel()
                assert size % 64 == 0
                base = pool[0].blob.data_ptr()
                assert [s.blob.data_ptr() - base for s in pool] == [i * size for i in range(len(pool))]
                assert len({s.blob.untyped_storage().data_ptr() for s in pool}) == 1


class FakeCudart:
    """Stands in for torch.cuda.cudart() on a machine without CUDA: records what the pool registers (the
    bookkeeping under test is ours; what page-locking does is checked on a GPU by tests/test_cuda.py)."""

    def __init__(self, error: int = 0):
        self.error, self.registered, self.unregistered, self.cleared = error, [], [], 0

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size))
        return self.error

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self):
        self.cleared += 1
        return 0


def test_a_pinned_pool_is_registered_exactly_once_and_unregistered_by_free_all(monkeypatch):
    from offload_engine.store.ledger import Ledger
    from offload_engine.store.tier import Tier

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    ledger = Ledger({"host": 64 << 20})
    tier = Tier("host", torch.device("cpu"), set())
    tier.allocate("expert", 5, 3 << 20, ledger, pin_memory=True)
    assert [size for _, size in fake.registered] == [5 * (3 << 20)]  # the exact bytes charged, one region
    assert ledger.peak()["host"] == 5 * (3 << 20)
    base = fake.registered[0][0]
    assert [s.blob.data_ptr() for s in tier.pools["expert"]] == [base + i * (3 << 20) for i in range(5)]
    tier.free_all(ledger)
    assert fake.unregistered == [base] and not tier.unpin


def test_a_pool_that_cannot_be_pinned_stays_pageable_with_a_warning(monkeypatch, caplog):
    from offload_engine.store.hostmem import pinned_host_buffer

    fake = FakeCudart(error=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    buf, unpin = pinned_host_buffer(4 * HUGE_PAGE)
    assert unpin is None and buf.numel() == 4 * HUGE_PAGE and fake.cleared == 1
    assert "could not page-lock" in caplog.text
