"""The KV BEGIN frame with and without FLAG_TRACE (kv_transfer/tcp/frames.py):
without a traceparent the frame is byte for byte what it was, with one the
decode pod reads it back, and every other field round-trips either way."""

from __future__ import annotations

import pytest

from kv_transfer.base import KVLayout
from kv_transfer.errors import TransferRefused
from kv_transfer.layout import SenderPart
from kv_transfer.tcp.frames import (
    FLAG_HEAD_RANGE,
    FLAG_TOKEN_OFFSET,
    FLAG_TRACE,
    begin_flags,
    begin_traceparent,
    decode_begin,
    encode_begin,
)
from kv_transfer.wire import FLAG_HEAD_RANGE as WIRE_HEAD_RANGE

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TICKET, ATTEMPT = b"t" * 24, b"a" * 16


def _layouts():
    yield KVLayout(4, 10, 2, 8, "float32")
    yield KVLayout(4, 10, 2, 8, "float32", token_offset=5)
    ranged = KVLayout(4, 10, 2, 8, "float32", 3, 2, 8)
    yield ranged


def test_the_trace_flag_is_the_next_free_bit():
    assert FLAG_HEAD_RANGE == WIRE_HEAD_RANGE == 8
    assert FLAG_TRACE == 16
    assert not FLAG_TRACE & (FLAG_TOKEN_OFFSET | FLAG_HEAD_RANGE | 1 | 2)


@pytest.mark.parametrize("layout", list(_layouts()), ids=lambda layout: layout.describe())
def test_begin_round_trips_with_and_without_a_traceparent(layout):
    part = SenderPart(0, 1, 2) if layout.head_ranged else None
    plain = encode_begin(layout, TICKET, ATTEMPT, part)
    assert encode_begin(layout, TICKET, ATTEMPT, part, "") == plain  # byte for byte
    assert begin_flags(layout, "") == begin_flags(layout)
    assert not begin_flags(layout) & FLAG_TRACE
    traced = encode_begin(layout, TICKET, ATTEMPT, part, PARENT)
    flags = begin_flags(layout, PARENT)
    assert flags == begin_flags(layout) | FLAG_TRACE
    assert traced == plain + PARENT.encode()
    assert decode_begin(traced, flags) == decode_begin(plain, begin_flags(layout))
    assert decode_begin(plain, begin_flags(layout))[:3] == (layout, TICKET, ATTEMPT)
    assert begin_traceparent(traced, flags) == PARENT
    assert begin_traceparent(plain, begin_flags(layout)) == ""


def test_a_bad_traceparent_is_refused_by_the_sender_and_ignored_by_the_receiver():
    layout = KVLayout(4, 10, 2, 8, "float32")
    with pytest.raises(ValueError, match="traceparent"):
        encode_begin(layout, TICKET, ATTEMPT, None, "00-xyz")
    garbage = encode_begin(layout, TICKET, ATTEMPT) + b"x" * 55
    assert begin_traceparent(garbage, FLAG_TRACE) == ""
    # the tail is still cut off, so the rest parses
    assert decode_begin(garbage, FLAG_TRACE)[:3] == (layout, TICKET, ATTEMPT)
    with pytest.raises(TransferRefused, match="too short"):
        decode_begin(b"\0" * 20, FLAG_TRACE)


def _grpc_begin(traceparent: str) -> bytes:
    import time

    from kv_transfer.grpc.sender import _begin_frame
    from kv_transfer.outgoing import Outgoing
    from kv_transfer.target import TransferTarget
    layout = KVLayout(4, 10, 2, 8, "float32")
    target = TransferTarget(("127.0.0.1:1",), TICKET, "grpc", 1, time.time() + 60,
                            traceparent=traceparent)
    return _begin_frame("r1", target, layout, Outgoing("r1", target, layout, None, ATTEMPT, 1))


def test_the_grpc_connectors_begin_carries_it_in_field_24():
    from kv_transfer.grpc.codec import decode_frame
    from proto import pdserve_pb2
    plain, traced = _grpc_begin(""), _grpc_begin(PARENT)
    assert decode_frame(plain).flags == 0 and decode_frame(plain).traceparent == ""
    frame = decode_frame(traced)
    assert frame.flags == FLAG_TRACE and frame.traceparent == PARENT
    assert (frame.ticket, frame.num_layers, frame.payload) == (TICKET, 4, ATTEMPT)
    # the generated class reads it too: proto/pdserve.proto declares `traceparent = 24`
    generated = pdserve_pb2.KVFrame.FromString(traced)
    assert generated.ticket == TICKET and generated.flags == FLAG_TRACE
    assert generated.traceparent == PARENT
