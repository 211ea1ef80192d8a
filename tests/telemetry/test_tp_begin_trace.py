"""At TP > 1 every per-rank BEGIN carries the request's traceparent
(docs/tracing.md): a decode pod's per-rank targets (`TransferTarget.for_rank`)
and a prefill pod's workers (the EXPORT message, prefill_service/
rank_messages.py) keep it, so each rank's TCP and gRPC BEGIN has FLAG_TRACE
and the same trace id as the rank-0 one."""

from __future__ import annotations

import json

import pytest

from engine.parallel.shard import kv_head_range
from kv_transfer.base import KVLayout, RankTarget, TransferTarget
from kv_transfer.grpc.codec import decode_frame
from kv_transfer.grpc.sender import _begin_frame
from kv_transfer.outgoing import Outgoing
from kv_transfer.tcp.frames import FLAG_TRACE, begin_flags, begin_traceparent, encode_begin
from prefill_service.rank_messages import export_fields, parse_export
from prefill_service.rank_sends import new_attempts, rank_sends
from telemetry.context import parse_traceparent

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
LAYOUT = KVLayout(num_layers=2, num_tokens=6, num_kv_heads=4, head_dim=8, dtype="float32")


def _target(b: int, transport: str, traceparent: str = PARENT) -> TransferTarget:
    ranks = tuple(RankTarget((f"127.0.0.1:{7000 + d}",), *kv_head_range(4, d, b))
                  for d in range(b))
    return TransferTarget(ranks[0].endpoints, b"ticket", transport, 3, 1e10, ranks=ranks,
                          tensor_parallel_size=b, traceparent=traceparent)


def _worker_view(target: TransferTarget, attempts: tuple[bytes, ...]) -> TransferTarget:
    """The target as a prefill worker rank reads it from EXPORT (over JSON)."""
    fields = json.loads(json.dumps(export_fields("r1", target, LAYOUT, attempts)))
    return parse_export(fields)[1]


def _begins(target: TransferTarget, prefill_tp: int) -> list[tuple[int, str]]:
    """(decode rank, the traceparent its BEGIN carries) for every send of
    every prefill rank, read back from the encoded frame."""
    attempts = new_attempts(target)
    seen = []
    for p in range(prefill_tp):
        view = target if p == 0 else _worker_view(target, attempts)
        for send in rank_sends(view, LAYOUT, p, prefill_tp, attempts):
            out = Outgoing("r1", send.target, send.layout, send.heads, send.attempt,
                           send.num_senders)
            if target.transport == "tcp":
                flags = begin_flags(send.layout, send.target.traceparent)
                payload = encode_begin(send.layout, send.target.ticket, out.attempt, out.part,
                                       send.target.traceparent)
                assert flags & FLAG_TRACE
                seen.append((send.decode_rank, begin_traceparent(payload, flags)))
            else:
                frame = decode_frame(_begin_frame("r1", send.target, send.layout, out))
                assert frame.flags & FLAG_TRACE
                seen.append((send.decode_rank, frame.traceparent))
    return seen


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 2), (2, 4), (4, 2)])
def test_every_rank_begin_carries_the_same_trace(transport, prefill_tp, decode_tp):
    seen = _begins(_target(decode_tp, transport), prefill_tp)
    assert {d for d, _ in seen} == set(range(decode_tp))  # every decode rank gets a BEGIN
    assert {parent for _, parent in seen} == {PARENT}
    assert parse_traceparent(seen[0][1]).trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_an_untraced_target_stays_untraced_on_every_rank():
    target = _target(2, "tcp", traceparent="")
    assert all(target.for_rank(d).traceparent == "" for d in range(2))
    attempts = new_attempts(target)
    assert _worker_view(target, attempts).traceparent == ""
    for send in rank_sends(_worker_view(target, attempts), LAYOUT, 1, 2, attempts):
        assert not begin_flags(send.layout, send.target.traceparent) & FLAG_TRACE
