"""engine/parallel/placement.py: a CPU TP pod's CPUs split into one share
per rank, and rank 0's placement undone when its group closes."""

from __future__ import annotations

import os

import pytest
import torch

from engine.parallel.placement import cpu_shares, place, restore


def test_cpus_split_into_contiguous_shares_larger_first() -> None:
    assert cpu_shares(2, [0, 1]) == [(0,), (1,)]
    assert cpu_shares(2, [0, 1, 2, 3, 4]) == [(0, 1, 2), (3, 4)]
    assert cpu_shares(4, list(range(8))) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert cpu_shares(1, [3, 5]) == [(3, 5)]
    assert cpu_shares(4, [0, 1]) is None  # fewer CPUs than ranks: nothing pinned
    with pytest.raises(ValueError, match="tensor-parallel size must be >= 1, got 0"):
        cpu_shares(0, [0])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_place_pins_and_restore_undoes_it() -> None:
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    first = min(before[0])
    previous = place((first,))
    try:
        assert os.sched_getaffinity(0) == {first}
        assert torch.get_num_threads() == 1
    finally:
        restore(previous)
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before
    previous = place(())  # no share: one thread, affinity unchanged
    try:
        assert os.sched_getaffinity(0) == before[0] and torch.get_num_threads() == 1
    finally:
        restore(previous)
