"""The send plan between a prefill pod at TP=a and a decode pod at TP=b."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.parallel import shard
from kv_transfer.tp_plan import SubTransfer, kv_head_range, send_plan, senders_of, sends_of

SIZES = (1, 2, 4, 8)


def _shardable(heads: int, size: int) -> bool:
    return heads % size == 0 or size % heads == 0


CASES = [
    (heads, a, b)
    for heads in range(1, 17)
    for a in SIZES
    for b in SIZES
    if _shardable(heads, a) and _shardable(heads, b)
]


@pytest.mark.parametrize(("heads", "a", "b"), CASES)
def test_every_decode_rank_gets_its_heads_once_from_the_lowest_holder(heads, a, b):
    plan = send_plan(heads, a, b)
    assert list(plan) == sorted(plan, key=lambda s: (s.decode_rank, s.head_start))
    for d in range(b):
        start, end = kv_head_range(heads, d, b)
        got = Counter(h for s in senders_of(plan, d) for h in range(s.head_start, s.head_end))
        assert got == Counter(range(start, end))  # covered exactly once, nothing else
        for s in senders_of(plan, d):
            for h in range(s.head_start, s.head_end):
                holders = [p for p in range(a)
                           if kv_head_range(heads, p, a)[0] <= h < kv_head_range(heads, p, a)[1]]
                assert s.prefill_rank == min(holders)
        ranks = [s.prefill_rank for s in senders_of(plan, d)]
        assert len(ranks) == len(set(ranks))  # merged: one SubTransfer per pair
    total = sum(s.num_heads for s in plan)
    assert total == sum(kv_head_range(heads, d, b)[1] - kv_head_range(heads, d, b)[0]
                        for d in range(b))
    if b <= heads:
        assert total == heads  # no head moves twice
    assert sum((sends_of(plan, p) for p in range(a)), ()) == tuple(
        sorted(plan, key=lambda s: (s.prefill_rank, s.decode_rank, s.head_start)))


@pytest.mark.parametrize(("heads", "a", "b"), CASES)
def test_head_ranges_agree_with_the_engines(heads, a, b):
    for size in (a, b):
        for rank in range(size):
            assert kv_head_range(heads, rank, size) == shard.kv_head_range(heads, rank, size)


def test_exact_plans():
    # 8 heads, prefill TP=2 -> decode TP=4: each prefill rank feeds two decode ranks
    assert send_plan(8, 2, 4) == (
        SubTransfer(0, 0, 0, 2), SubTransfer(0, 1, 2, 4),
        SubTransfer(1, 2, 4, 6), SubTransfer(1, 3, 6, 8),
    )  # fmt: skip
    # 4 heads, prefill TP=4 -> decode TP=1: four senders into one layout
    assert send_plan(4, 4, 1) == tuple(SubTransfer(p, 0, p, p + 1) for p in range(4))
    # 2 heads replicated on prefill TP=8 (ranks 0-3 hold head 0, 4-7 head 1) -> TP=1:
    # only ranks 0 and 4 send
    assert send_plan(2, 8, 1) == (SubTransfer(0, 0, 0, 1), SubTransfer(4, 0, 1, 2))
    # 1 head -> decode TP=4 replicates it: every decode rank gets it from rank 0
    assert send_plan(1, 2, 4) == tuple(SubTransfer(0, d, 0, 1) for d in range(4))
    assert send_plan(6, 1, 1) == (SubTransfer(0, 0, 0, 6),)


def test_sends_and_senders():
    plan = send_plan(4, 2, 4)
    assert sends_of(plan, 1) == (SubTransfer(1, 2, 2, 3), SubTransfer(1, 3, 3, 4))
    assert senders_of(plan, 0) == (SubTransfer(0, 0, 0, 1),)
    assert sends_of(plan, 5) == ()


def test_unshardable_sizes_are_refused():
    with pytest.raises(ValueError, match="prefill TP size 4 cannot hold 6 KV heads"):
        send_plan(6, 4, 1)
    with pytest.raises(ValueError, match="decode TP size 8 cannot hold 3 KV heads"):
        send_plan(3, 1, 8)
    with pytest.raises(ValueError, match="empty"):
        SubTransfer(0, 0, 2, 2)
