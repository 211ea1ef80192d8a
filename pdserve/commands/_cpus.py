"""CPU pinning of a pdserve process: `--cpus LIST` on the pod and router
commands, `--{role}-cpus LIST` on `pdserve up`.

A list is Linux's cpuset syntax: comma-separated CPU ids and inclusive
ranges, e.g. `0`, `0-1`, `0,2`, `0-3,8-11`. Every CPU must be one this
process may run on (`os.sched_getaffinity(0)`, which already reflects
taskset, cgroups and a Kubernetes static CPU manager policy); otherwise the
error names the list and the allowed CPUs.

Pinning is applied once, at startup, on the main thread before the engine or
any server starts: every thread the process has at that point gets the new
mask (later threads inherit it), and torch's intra-op pool is sized to the
number of pinned CPUs unless `--threads` says otherwise, so one process never
runs more compute threads than it has cores (what operators do when they pin
pods to NUMA nodes).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("pdserve.cpus")

# libgomp's idle spin in a pod process, in spins (~20 ns each here): long
# enough to bridge the gaps between a step's ~270 parallel regions, short
# enough to give the core back between steps. libgomp's own default
# (300,000, milliseconds of spinning after each region) kept a pod's worker
# on a core it shares with the other pod, the router or a CFS quota: a
# 0.16 s KV transfer deadline was missed beside it (docs/engine.md,
# "OpenMP pools"). Read by libgomp when torch loads it: set before that.
POD_SPIN_COUNT = 2000


def default_pod_spin() -> None:
    """GOMP_SPINCOUNT for this pod process, unless the operator set it or a
    wait policy (OMP_WAIT_POLICY), which libgomp reads instead."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(POD_SPIN_COUNT)


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on, ascending."""
    return tuple(sorted(os.sched_getaffinity(0)))


def format_cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    """`(0, 1, 2, 5)` -> "0-2,5" (the cpuset syntax `parse_cpu_list` reads)."""
    parts: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpu_list(text: str, allowed: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The CPU ids of a cpuset list, ascending and without repeats.

    ValueError (naming `text` and the allowed CPUs) for a malformed list, a
    reversed range, or a CPU outside `allowed` (default: `allowed_cpus()`).
    """
    allowed = allowed_cpus() if allowed is None else allowed
    hint = f"this machine allows CPUs {format_cpu_list(allowed)}"
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not (low.isdigit() and (not dash or high.isdigit())):
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU id or a range "
                             f"like 0-3 ({hint})")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"CPU list {text!r}: range {part} runs backwards ({hint})")
        cpus.update(range(first, last + 1))
    outside = sorted(cpus - set(allowed))
    if outside:
        raise ValueError(f"CPU list {text!r}: CPU {format_cpu_list(outside)} is not available "
                         f"({hint})")
    return tuple(sorted(cpus))


def cpu_list_type(text: str) -> tuple[int, ...]:
    """argparse `type=` for a CPU list: argparse prints the message and exits 2."""
    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _whole_number(text: str, low: int, high: int | None, rule: str) -> int:
    """argparse `type=` body: `text` as an int in [low, high] (high None: no
    limit), else the error names `rule` and the text."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be a whole number {rule}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1, None, ">= 1")


def _nice_value(text: str) -> int:
    return _whole_number(text, 0, 19, "from 0 to 19")


def add_pinning_arguments(parser: argparse.ArgumentParser, *, threads: bool) -> None:
    """`--cpus` (and `--threads` for processes that run torch compute)."""
    g = parser.add_argument_group("placement")
    g.add_argument("--cpus", type=cpu_list_type, default=None, metavar="LIST",
                   help="Pin this process to these CPUs, e.g. 0, 0-1, 0,2 (default: every "
                        "CPU it may use).")
    if threads:
        g.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                       help="torch intra-op threads (default: the number of --cpus, else "
                            "torch's own default).")
        g.add_argument("--nice", type=_nice_value, default=0, metavar="N",
                       help="CPU scheduling niceness of every thread, 0-19 (default 0), for "
                            "a pod sharing cores with other work. It does not keep a "
                            "prefill pod off a decode pod's shared cores: docs/defaults.md.")


def pin_process(cpus: tuple[int, ...] | None, threads: int | None = None, *,
                torch_threads: bool = True, nice: int = 0) -> None:
    """Pin every thread of this process to `cpus`, set its niceness and
    size torch's pool.

    Call on the main thread at startup (threads started later inherit both
    the affinity and the niceness). `cpus=None` leaves the affinity as it is;
    `threads=None` means one torch thread per pinned CPU (torch's default
    when nothing is pinned). ValueError for `threads < 1`.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if nice:  # Linux keeps a niceness per thread
        _each_thread(lambda task: os.setpriority(os.PRIO_PROCESS, task, nice))
        log.info("niceness %d (pid %d)", nice, os.getpid())
    if cpus is not None:
        _each_thread(lambda task: os.sched_setaffinity(task, cpus))
        log.info("pinned to CPUs %s (pid %d)", format_cpu_list(cpus), os.getpid())
    if not torch_threads:
        return
    count = threads if threads is not None else (len(cpus) if cpus is not None else None)
    if count is not None:
        import torch

        torch.set_num_threads(count)
        log.info("torch intra-op threads: %d", count)


def _each_thread(apply: Callable[[int], object]) -> None:
    """`apply(thread id)` for every thread of this process now, skipping
    one that ended meanwhile."""
    for task in _thread_ids():
        try:
            apply(task)
        except ProcessLookupError:
            pass


def _thread_ids() -> list[int]:
    """Every thread of this process (Linux: /proc/self/task), else just this one."""
    tasks = Path("/proc/self/task")
    if tasks.is_dir():
        return [int(entry.name) for entry in tasks.iterdir()]
    return [0]
