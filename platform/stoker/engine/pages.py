"""Pages of the engine's CPU memory, mapped in or handed back ahead of need: `fault_in`, `release_pages`.

Wakes at the floor: the first token after a wake should cost what it costs on an engine that never
slept. Two things made it cost more (measured with SmolLM2-135M on this 2-core CPU, where a first
token takes 0.09-0.3 s): the weights, mapped again from the snapshot, were faulted in page by page
by the first forward pass (132,000 faults of 4 KiB), and a new batching manager wrote its whole KV
cache with `torch.zeros` (380 MB) before the first step. `fault_in` maps the weights during the
wake instead; `release_pages` lets sleep keep the KV cache's allocation while handing all of its
memory back, so a wake allocates nothing (`core.Engine._keep_manager`).

Linux and glibc only (`madvise`); elsewhere `fault_in` reads one byte per page and `release_pages`
releases nothing.
"""

from __future__ import annotations

import ctypes
import functools
import itertools

import torch

PAGE_BYTES = 4096
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14


def fault_in(model: torch.nn.Module) -> int:
    """Map every page of the model's CPU weights into the process now, so that no request faults.

    Memory-mapped weights are page-cache pages the process has not touched yet: the first forward
    pass would take one page fault per 4 KiB page (SmolLM2-135M: 132,000 of them, measured 0.07 s
    of a first token that should take 0.2 s on this CPU). `madvise(MADV_POPULATE_READ)` (Linux
    5.14+) maps each tensor's pages in one call without faulting, reading them from disk if they
    are not cached; on older kernels one byte per page is read instead. Tensors that are anonymous
    memory (converted dtypes) are resident already and cost nothing. Returns the bytes covered;
    nothing is done for weights on a GPU.
    """
    seen, total = set(), 0
    for param in itertools.chain(model.parameters(), model.buffers()):
        if param.device.type != "cpu" or param.is_meta:
            continue
        storage = param.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
        if not _populate(storage.data_ptr(), storage.nbytes()):
            flat = torch.empty(0, dtype=torch.uint8).set_(storage)
            flat[::PAGE_BYTES].max()  # one byte read per page
    return total


def release_pages(tensor: torch.Tensor) -> int:
    """Hand a CPU tensor's whole pages back to the OS (`MADV_DONTNEED`); returns the bytes released.

    The tensor stays allocated and valid: a private anonymous page read after this reads zeros, and
    is only backed by memory again once written. Used for the KV cache during sleep: it keeps its
    allocation (so the wake does not pay `torch.zeros` of hundreds of MB) but none of its memory.
    The partial pages at either end (shared with the allocator's own bookkeeping) are left alone.
    """
    if tensor.device.type != "cpu" or tensor.nbytes == 0:
        return 0
    start = -(-tensor.data_ptr() // PAGE_BYTES) * PAGE_BYTES
    end = (tensor.data_ptr() + tensor.nbytes) // PAGE_BYTES * PAGE_BYTES
    if end <= start or _madvise(start, end - start, MADV_DONTNEED) != 0:
        return 0
    return end - start


def _populate(address: int, length: int) -> bool:
    start = address // PAGE_BYTES * PAGE_BYTES
    return _madvise(start, address + length - start, MADV_POPULATE_READ) == 0


def _madvise(start: int, length: int, advice: int) -> int:
    """libc's madvise; -1 where it fails or there is no glibc."""
    madvise = _libc_madvise()
    return -1 if madvise is None else madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)


@functools.cache
def _libc_madvise():
    try:
        madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise
