"""`release_this_threads_pool`: the calling thread's OpenMP workers, ended.

libgomp keeps one pool of worker threads per thread that started a parallel
region, for the life of that thread, and counts every worker it manages.
Once it manages more threads than the process may use CPUs, it stops
letting idle workers spin between regions (100 spins, against 300,000):
each worker then sleeps on a futex the moment a region ends, and the next
region waits for the kernel to wake it. A CPU decode step is ~270 parallel
regions (the projections, attention, norms), so every one of them pays
that wake-up.

A pod builds its engine on the main thread (loading and prepacking run
parallel regions there: a pool) and steps it on the engine-loop thread (a
second pool). On two CPUs that is three workers and the throttled mode:
the 2-core VM's SmolLM2 decode step took 17.6-18.2 ms in bfloat16 there,
against 14.1-14.5 ms with the main thread's pool ended (docs/engine.md,
"OpenMP pools"); served, the pod's steps were 5-7 ms longer than the same
engine stepped on the thread that built it.

So `EngineLoop.start` ends the starting thread's pool, once the loop
thread is about to take over the engine. Nothing is lost if that thread
runs a parallel region later: libgomp starts a pool again.
`omp_pause_resource_all(omp_pause_hard)` (OpenMP 5.0; libgomp since
GCC 9, also in LLVM's and Intel's runtimes) is the standard call; it is
found in the OpenMP runtime torch loaded. Without one (torch built without
OpenMP, or another OS) this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, nothing kept
RUNTIMES = ("libgomp", "libiomp", "libomp")


@lru_cache(maxsize=1)
def _pause_all() -> ctypes._CFuncPtr | None:
    """omp_pause_resource_all of the OpenMP runtime loaded in this process."""
    import torch  # noqa: F401 - loads the OpenMP runtime the kernels' regions use

    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return None
    # a library is mapped several times (code, data): each path once, in order
    paths = dict.fromkeys(fields[5] for fields in map(str.split, maps.read_text().splitlines())
                          if len(fields) >= 6)
    for path in paths:
        if any(Path(path).name.startswith(name) for name in RUNTIMES):
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            fn.argtypes = (ctypes.c_int,)
            fn.restype = ctypes.c_int
            return fn
    log.debug("no OpenMP runtime with omp_pause_resource_all loaded")
    return None


def release_this_threads_pool() -> bool:
    """End the calling thread's OpenMP worker threads; whether it did."""
    pause = _pause_all()
    if pause is None:
        return False
    status = pause(OMP_PAUSE_HARD)
    if status != 0:  # e.g. called inside a parallel region
        log.debug("omp_pause_resource_all refused (%d)", status)
    return status == 0
