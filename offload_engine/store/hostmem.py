"""Host memory for weights on the CPU: anonymous mappings advised for transparent huge pages.

Why: decode on the CPU is memory-bound, and weights on 4 KiB pages pay a TLB miss every 4 KiB (in a VM a
two-level page walk). Measured on this project's 2-core VM: one expert's matmuls (3 MiB of fp32) took 0.34-0.38 ms
from huge-page memory and 0.37-0.64 ms from torch.empty memory, depending on which physical pages the allocator
got; the whole bench model decoded at ~0.6 ms per expert from torch.empty memory in a slow phase. torch's own
allocator uses huge pages only under an environment variable read once per process (THP_MEM_ALLOC_ENABLE), and
then per allocation, so a 3 MiB slot still gets one huge page and 1 MiB of small ones: a slot pool is one
region here instead.

Only the 2 MiB-aligned interior is advised, and the region's tail past `nbytes` is never touched, so the
process's resident memory stays within the bytes asked for (what the ledger charged).

The bytes asked for are faulted in when the region is made (MADV_POPULATE_WRITE; touching a byte per page where
the kernel lacks it), not at their first use. A slot's first use is a direct read into it, and the kernel then
faults its pages in on the reader's path: on this project's VM (which hands freed guest memory back to its
host) a 3 MiB O_DIRECT read into never-touched memory took 1.3-5.5 ms against 0.9 ms into touched memory, and a
fresh engine at 25% of the bench model paid it on most of its first ~150 misses. Populating also surfaces a lack
of memory at open, as an error, instead of as the OOM killer in the middle of a request. CUDA's pinned pools are
faulted in by page-locking anyway. Pinned (CUDA host) pools
are such regions too, page-locked in place (`pinned_host_buffer`): torch's pinned allocator rounds every
allocation up to a power of two. Device memory keeps torch's allocator.
"""
from __future__ import annotations

import errno
import logging
import mmap
from typing import Callable

import torch

HUGE_PAGE = 2 << 20
# The OS page (madvise lengths, one write per page to fault memory in), not constants.PAGE: that is O_DIRECT's
# and the slots' 4 KiB grain, while a kernel with 16 or 64 KiB pages (arm64) faults and advises whole pages of its own
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; the mmap module names it from 3.13


def host_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes`: private anonymous memory, 2 MiB aligned and advised MADV_HUGEPAGE where
    the OS has it (Linux); torch.empty elsewhere and below one huge page. Out of memory: torch.OutOfMemoryError,
    as the allocator reports it (errors.out_of_memory_as_error turns it into a DeviceOOMError)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        if e.errno == errno.ENOMEM:
            raise torch.OutOfMemoryError(f"cannot map {nbytes} bytes of host memory: {e.strerror}") from None
        raise
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping: unmapped with the last view
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(advice, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP disabled or unsupported: ordinary pages, still correct
        pass
    buf = whole[start:start + nbytes]
    populate(region, start, buf)
    return buf


def populate(region: mmap.mmap, start: int, buf: torch.Tensor) -> None:
    """Fault in `buf`'s pages (`buf` = region[start:start + len]; `start` page-aligned), see the module's note."""
    length = -(-buf.numel() // PAGE) * PAGE
    try:
        region.madvise(MADV_POPULATE_WRITE, start, length)
        return
    except OSError as e:
        if e.errno in (errno.ENOMEM, errno.EFAULT):  # EFAULT: populating failed for lack of memory too
            raise torch.OutOfMemoryError(f"cannot fault in {buf.numel()} bytes of host memory: {e.strerror}") from None
        # EINVAL: a kernel before 5.14; write a byte per page instead (the same faults, one by one)
    buf[::PAGE].zero_()


def pinned_host_buffer(nbytes: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A host_buffer page-locked for CUDA in place (cudaHostRegister), so exactly `nbytes` are pinned: torch's
    pinned allocator (`pin_memory=True`) rounds each allocation up to a power of two, and a 9.4 MB expert slot
    would pin 16 MiB, up to twice what the ledger charged. Returns the buffer and the function that unpins it
    (call it before the last view goes); where registering fails (a locked-memory limit, say) the buffer stays
    pageable, with a warning: copies from it still work, synchronously, and the second item is None."""
    buf = host_buffer(nbytes)
    cudart = torch.cuda.cudart()
    ptr = buf.data_ptr()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        clear = getattr(cudart, "cudaGetLastError", None)  # the failure must not surface at a later launch check
        if clear is not None:
            clear()
        logging.getLogger("offload_engine").warning(
            "could not page-lock %d bytes of host memory for CUDA (cudaHostRegister error %d): host-to-device "
            "copies from this pool run synchronously", nbytes, err)
        return buf, None
    return buf, lambda: cudart.cudaHostUnregister(ptr)
