"""What each prefill rank sends (prefill_service/rank_sends.py), the EXPORT
message that tells a worker (rank_messages.py), and how one request's
outcome is decided from its parts (outcomes.py)."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest

from engine.parallel.shard import kv_head_range
from kv_transfer.base import KVLayout, RankTarget, TransferOutcome, TransferTarget
from prefill_service.outcomes import first_failure
from prefill_service.rank_messages import export_fields, parse_export
from prefill_service.rank_sends import bytes_moved, new_attempts, rank_sends, sending_ranks

LAYOUT = KVLayout(num_layers=3, num_tokens=10, num_kv_heads=4, head_dim=8, dtype="float32",
                  token_offset=6)


def _target(b: int, heads: int = 4) -> TransferTarget:
    if b == 1:
        return TransferTarget(("10.0.0.1:7000",), b"ticket", "tcp", 9, 1e9)
    ranks = tuple(RankTarget((f"10.0.0.1:{7000 + d}",), *kv_head_range(heads, d, b))
                  for d in range(b))
    return TransferTarget(ranks[0].endpoints, b"ticket", "tcp", 9, 1e9, ranks=ranks,
                          tensor_parallel_size=b)


def test_tp1_to_tp1_is_todays_one_whole_transfer():
    target = _target(1)
    (send,) = rank_sends(target, LAYOUT, 0, 1, ())
    assert (send.target, send.layout, send.heads, send.attempt) == (target, LAYOUT, None, None)
    assert send.local_heads == (0, 4) and send.num_senders == 1
    assert sending_ranks(4, 1, target) == (0,)


@pytest.mark.parametrize("a", [1, 2, 4, 8])
@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_every_decode_head_comes_once_from_a_rank_holding_it(a, b):
    target, heads = _target(b), LAYOUT.num_kv_heads
    if (a, b) == (1, 1):
        return
    attempts = new_attempts(target)
    assert len(attempts) == b and len(set(attempts)) == b
    landed: dict[int, list[int]] = {d: [] for d in range(b)}
    for p in range(a):
        mine = kv_head_range(heads, p, a)
        for send in rank_sends(target, LAYOUT, p, a, attempts):
            d = send.decode_rank
            start, end = kv_head_range(heads, d, b)
            assert send.layout == LAYOUT.head_share(start, end)
            assert send.target.endpoints == (f"10.0.0.1:{7000 + d}",) or b == 1
            assert send.attempt == attempts[d]
            # the same global heads, seen from the layout and from this rank's shard
            glob = (start + send.heads[0], start + send.heads[1])
            assert glob == (mine[0] + send.local_heads[0], mine[0] + send.local_heads[1])
            assert mine[0] <= glob[0] < glob[1] <= mine[1]
            landed[d] += range(*glob)
    for d in range(b):
        assert sorted(landed[d]) == list(range(*kv_head_range(heads, d, b)))
    senders = {p for p in range(a) if rank_sends(target, LAYOUT, p, a, attempts)}
    assert sending_ranks(heads, a, target) == tuple(sorted(senders))
    assert bytes_moved(LAYOUT, target) == LAYOUT.total_bytes // heads * max(heads, b)


def test_a_target_sharded_otherwise_is_refused_by_name():
    ranks = (RankTarget(("h:1",), 0, 3), RankTarget(("h:2",), 3, 4))
    target = TransferTarget(("h:1",), b"t", "tcp", 1, 1e9, ranks=ranks, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"target rank 0 of 2 holds KV heads \[0, 3\); this "
                                         r"prefill pod shards .* as \[0, 2\)"):
        rank_sends(target, LAYOUT, 0, 2, new_attempts(target))


def test_export_message_round_trips_through_json():
    target = _target(4)
    attempts = new_attempts(target)
    fields = json.loads(json.dumps(export_fields("req-1", target, LAYOUT, attempts)))
    assert parse_export(fields) == ("req-1", target, LAYOUT, attempts)


def _done(outcome: TransferOutcome) -> Future:
    future: Future = Future()
    future.set_result(outcome)
    return future


def test_first_failure_decides_at_once_and_complete_needs_every_part():
    parts = [Future(), Future(), Future()]
    reasons: list[str] = []
    combined = first_failure(parts, on_failure=reasons.append)
    parts[0].set_result(TransferOutcome.complete())
    assert not combined.done()
    parts[2].set_result(TransferOutcome.failed("connection_lost: peer gone"))
    assert combined.result(0).reason == "connection_lost: peer gone"
    assert reasons == ["connection_lost: peer gone"]
    parts[1].set_result(TransferOutcome.failed("aborted: later"))  # too late to matter
    assert combined.result(0).reason == "connection_lost: peer gone" and len(reasons) == 1
    ok = first_failure([_done(TransferOutcome.complete()), _done(TransferOutcome.complete())])
    assert ok.result(0).ok
    assert first_failure([]).result(0).ok


def test_a_verdict_nobody_waits_for_any_more_is_dropped_quietly():
    """asyncio.wrap_future cancels a part's future when the awaiting Prefill RPC is
    cancelled; the outcome that arrives later (an abort, a verdict) must not raise
    (it did: InvalidStateError out of the servicer's cancel path)."""
    from concurrent.futures import Future

    from kv_transfer.base import TransferOutcome
    from prefill_service.outcomes import first_failure

    part: Future = Future()
    combined = first_failure([part], on_failure=lambda why: failures.append(why))
    failures: list[str] = []
    assert combined.cancel()
    part.set_result(TransferOutcome.failed("aborted: prefill RPC cancelled"))
    assert failures == ["aborted: prefill RPC cancelled"]  # the other parts are still told
