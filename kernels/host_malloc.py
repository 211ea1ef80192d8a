"""`keep_freed_memory`: glibc malloc told to keep what a CPU forward frees.

A CPU prefill step allocates and frees each layer's activations: at 1,792
prompt tokens of SmolLM2 in float32 the gate/up output alone is 22 MB, and
there are several such tensors a layer, 30 layers a step. glibc returns
freed memory to the kernel: chunks above its mmap threshold are unmapped
on free, and free space at the top of a heap above its trim threshold is
given back (`brk` down, or MADV_DONTNEED in a thread's arena: a pod's
forward runs on its engine-loop thread). The next layer's allocation then
faults every 4 KiB page back in. Measured on the 2-core VM: 7,000 to
117,000 minor faults per 7 x 256-token prefill step (up to 457 MB faulted
again), the step 1.03-1.16 s against 1.03 s with none (docs/engine.md,
"Host memory").

So, once per process, before the first step (`LLMEngine` on CPU):
- the mmap threshold is fixed at its largest (32 MiB on 64-bit glibc),
  which also stops glibc from adapting it, so activations up to that size
  come from the heap and are reused;
- the trim threshold is made effectively infinite, so a heap never shrinks;
- the top pad (64 MiB) grows a heap in large steps.
The process keeps its peak working set instead of returning it between
layers, which is what a serving pod wants: the peak comes back every
prompt. Allocations above 32 MiB (prompts of several thousand tokens in one
step) are still mapped per call.

`mallopt` is glibc's; elsewhere (musl, macOS) this does nothing and says so
at debug level. vLLM's CPU guide gets the same effect by preloading tcmalloc;
pdserve needs no preload.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache

log = logging.getLogger(__name__)

# malloc.h
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# HEAP_MAX_SIZE / 2 on 64-bit glibc: mallopt refuses a larger mmap threshold
MMAP_THRESHOLD_MAX = 32 << 20
TOP_PAD = 64 << 20
# mallopt takes an int: INT_MAX (2 GiB) is more free heap top than any
# step leaves, so "never" in practice
NEVER_TRIM = 2**31 - 1

SETTINGS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, NEVER_TRIM),
            (M_TOP_PAD, TOP_PAD))


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Apply the settings above once; whether glibc took all of them."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no glibc mallopt here: freed host memory goes back to the kernel")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    taken = True
    for param, value in SETTINGS:
        if mallopt(param, value) != 1:
            log.warning("glibc refused mallopt(%d, %d)", param, value)
            taken = False
    return taken
