"""TransferTarget with one receiver per decode rank."""

from __future__ import annotations

import pytest

from kv_transfer.target import RankTarget, TransferTarget
from kv_transfer.target_wire import target_from_proto, target_to_proto

R0 = RankTarget(("127.0.0.1:7000",), 0, 2)
R1 = RankTarget(("127.0.0.1:7001",), 2, 4)


def _target(**kwargs) -> TransferTarget:
    args = dict(endpoints=("127.0.0.1:7000",), ticket=b"t", transport="tcp", generation=3,
                deadline=1.5) | kwargs
    return TransferTarget(**args)


def test_a_tp1_target_has_no_ranks():
    target = _target()
    assert target.ranks == () and target.tensor_parallel_size == 1 and target.num_ranks == 1
    assert target.for_rank(0) is target
    with pytest.raises(ValueError, match="decode rank 1 of a TP=1 target"):
        target.for_rank(1)


def test_ranks_and_their_targets():
    target = _target(ranks=(R0, R1), tensor_parallel_size=2)
    assert target.num_ranks == 2
    assert target.for_rank(1) == TransferTarget(("127.0.0.1:7001",), b"t", "tcp", 3, 1.5)
    with pytest.raises(ValueError, match="outside"):
        target.for_rank(2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(ranks=(R0,), tensor_parallel_size=2), "1 ranks for tensor_parallel_size 2"),
        (dict(tensor_parallel_size=2), "without ranks"),
        (dict(ranks=(R1, R0), tensor_parallel_size=2), "not rank 0's"),
        (dict(ranks=[R0], tensor_parallel_size=1), "tuple of RankTarget"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    ],
)
def test_ranks_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _target(**kwargs)


def test_rank_target_validation():
    with pytest.raises(ValueError, match="head_end"):
        RankTarget(("127.0.0.1:7000",), 2, 2)
    with pytest.raises(ValueError, match="endpoint"):
        RankTarget(("nohost",), 0, 1)
    with pytest.raises(ValueError, match="non-empty"):
        RankTarget((), 0, 1)


def test_proto_round_trip():
    tp1 = _target(deadline=1700000000.25)
    msg = target_to_proto(tp1, num_held_tokens=32)
    assert msg.num_held_tokens == 32 and not msg.ranks and msg.tensor_parallel_size == 0
    assert target_from_proto(msg) == tp1
    tp2 = _target(deadline=1700000000.5, ranks=(R0, R1), tensor_parallel_size=2)
    msg = target_to_proto(tp2)
    assert [tuple(r.endpoints) for r in msg.ranks] == [R0.endpoints, R1.endpoints]
    assert [(r.head_start, r.head_end) for r in msg.ranks] == [(0, 2), (2, 4)]
    assert target_from_proto(msg) == tp2
    msg.ranks[1].head_end = 2  # an empty range names the field
    with pytest.raises(ValueError, match="head_end"):
        target_from_proto(msg)
