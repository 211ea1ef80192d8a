"""CPU tensors on transparent huge pages, for memory a decode step sweeps.

A CPU decode step reads every dense weight and every running sequence's KV
once. On 4 KiB pages that is one TLB entry per 4 KiB: the base model's
365 MB of weights are ~89,000 pages a step, far past any TLB, and each miss
walks page tables that the sweep itself has pushed out of cache. With 2 MiB
pages the same bytes are ~180 entries (docs/engine.md, Dense projections, "Huge pages").

`zeros(shape, dtype)` maps anonymous memory, asks the kernel for huge pages
on it (`madvise(MADV_HUGEPAGE)`: what Linux's default THP mode,
`madvise`, needs) before the first touch, has every page of it allocated
at once (`populate`), and returns a zeroed tensor on its first 2 MiB
boundary.

Populated at once, because anonymous memory is otherwise allocated page by
page on its first write: the KV cache would fault while serving, each
prompt's first write of fresh blocks paying the kernel's fault, zeroing and
(`defrag` in `madvise` mode) compaction, and in a virtual machine the
host's fault too. On the 2-core VM (docs/engine.md, "Huge pages") that
made a closed loop of 256-token prompts 12 % slower on a 2 GiB cache than
on a warm one, its prompts' steps 1.3x longer. At start the whole cache is
faulted in once (`MADV_POPULATE_WRITE`, Linux 5.14; else by writing every
page), and memory the pod cannot have fails it at start rather than
mid-request. Where the kernel has no transparent huge pages
(`/sys/kernel/mm/transparent_hugepage/enabled` is `never` or missing, or
not Linux) or the tensor is under one huge page, it is plain `torch.zeros`.
Either way the contents and the layout are the same; only the page size
differs, and the kernel may still fall back to small pages (fragmented
memory), which is correct, only slower.

The tensor keeps its mapping alive (`torch.frombuffer` holds the buffer)
and the mapping is unmapped when the last view of it is freed.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# asm-generic/mman-common.h (x86-64, arm64); Python defines it from 3.12 on.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether this kernel gives transparent huge pages to a madvised mapping."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = THP_ENABLED.read_text()
    except OSError:
        return False
    # "always [madvise] never": the bracketed word is the mode in force
    return "[never]" not in mode


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor, on huge pages where the kernel has them."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not available():
        return torch.zeros(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE,
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as exc:
        log.warning("no huge-page mapping of %d bytes (%s); using small pages", nbytes, exc)
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    populate(region, raw)
    start = -raw.data_ptr() % HUGE_PAGE
    # anonymous memory is zero-filled: nothing to clear
    return raw[start:start + nbytes].view(dtype).view(shape)


def populate(region: mmap.mmap, raw: torch.Tensor) -> None:
    """Allocate every page of a fresh anonymous mapping now (module docstring).

    `raw` is the mapping as bytes; writing zeros over it is the fallback
    where the kernel lacks MADV_POPULATE_WRITE (EINVAL before Linux 5.14).
    Memory the kernel cannot give is a MemoryError here, at start, where
    writing it would have the process killed mid-request.
    """
    try:
        region.madvise(MADV_POPULATE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise MemoryError(f"cannot have {len(region)} bytes of memory resident "
                              f"({exc.strerror}); lower --kv-cache-memory or give the pod "
                              "more memory") from exc
        raw.zero_()


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor, on huge pages where the kernel has them."""
    out = zeros(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out
