"""Where each rank of a CPU tensor-parallel pod computes.

A CPU pod at TP=N splits the CPUs it may run on (its affinity, e.g. from
`--cpus`) into N contiguous shares, one per rank, each rank pinned to its
share with one torch thread per CPU: N processes each running its own
threads on the same cores would oversubscribe them, and every all-reduce
waits for the slowest rank. Rank 0 keeps its share for the engine loop
and the gRPC server too. With fewer CPUs than ranks nothing is pinned and
each rank gets one thread. CUDA ranks are not placed (their device is
their share).

Called by `TPLeader.start` (rank 0, before the workers start) and by each
worker at start-up.
"""

from __future__ import annotations

import os

import torch


def cpu_shares(size: int, cpus: list[int] | None = None) -> list[tuple[int, ...]] | None:
    """`size` contiguous shares of `cpus` (default: this process's affinity),
    the first ones one CPU larger when they do not divide evenly; None with
    fewer CPUs than ranks."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    if len(cpus) < size:
        return None
    base, extra = divmod(len(cpus), size)
    shares, start = [], 0
    for rank in range(size):
        end = start + base + (1 if rank < extra else 0)
        shares.append(tuple(cpus[start:end]))
        start = end
    return shares


Placement = tuple[tuple[int, ...] | None, int]  # (affinity or None, torch threads)


def place(cpus: tuple[int, ...]) -> Placement:
    """Pin this process to `cpus` with one torch thread each (with none
    given: one thread, the affinity as it is). Returns what it replaced,
    for `restore` (rank 0 undoes its placement when the group closes: in
    a test process the engine is not the process's only tenant)."""
    previous = (tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity")
                else None, torch.get_num_threads())
    if cpus and previous[0] is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(max(1, len(cpus)))
    return previous


def restore(previous: Placement) -> None:
    affinity, threads = previous
    if affinity is not None:
        os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)
