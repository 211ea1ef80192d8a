"""gRPC connector: a transfer survives its sender (restart against the same target).

Same semantics as tests/kv_transfer/tcp/test_tcp_restart.py; here a stream is
one `Push` call, so "the first sender's late frames" are frames on a call of
the superseded attempt.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.grpc import GrpcKVReceiver, GrpcKVSender
from proto import pdserve_pb2_grpc
from tests.kv_transfer.grpc.test_grpc import KIND, begin_frame, frame
from tests.kv_transfer.helpers import (
    KILLABLE_LAYOUT,
    RecordingListener,
    random_kv,
    send_all,
    start_killable_sender,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)
LAYOUT = KVLayout(3, 16, 2, 8, "float32")  # 2 KiB per layer
# The deadline leaves room for a loaded CI machine: the restart must be seen before it.
DEADLINE_S = 6.0
SUPERSEDED = "superseded: sender_lost: superseded by a new attempt"


@pytest.fixture
def listener():
    return RecordingListener()


@pytest.fixture
def receiver(listener):
    rx = GrpcKVReceiver(ReceiverConfig(capacity_bytes=16 << 20, claim_grace_s=1.0), listener)
    rx.start()
    yield rx
    rx.close()


def _sender() -> GrpcKVSender:
    return GrpcKVSender(SenderConfig(num_streams=3, max_chunk_bytes=4096))


def _layer_bytes(kv: torch.Tensor, layer: int) -> bytes:
    return kv[layer].contiguous().view(torch.uint8).numpy().tobytes()


def _held_call(receiver, frames: list, hold: threading.Event, late: list):
    """A Push call that sends `frames`, waits for `hold`, then sends `late`."""

    def stream():
        yield from frames
        hold.wait(30)
        yield from late

    stub = pdserve_pb2_grpc.KVTransferStub(grpc.insecure_channel(receiver.endpoints[0]))
    return stub.Push.future(stream(), timeout=60)


def _begin(rid, ticket, attempt: bytes):
    f = begin_frame(rid, LAYOUT, ticket)
    return frame(KIND.FRAME_KIND_BEGIN, rid, payload=attempt, ticket=f.ticket,
                 num_layers=f.num_layers, num_tokens=f.num_tokens,
                 num_kv_heads=f.num_kv_heads, head_dim=f.head_dim, dtype=f.dtype)  # fmt: skip


def _assert_delivered(listener, rid: str, kv: torch.Tensor) -> None:
    for layer in range(kv.shape[0]):
        got = listener.layers[(rid, layer)]
        assert torch.equal(got.view(torch.uint8), kv[layer].view(torch.uint8)), layer


def test_superseding_begin_refuses_the_first_calls_late_frames(receiver, listener):
    kv = random_kv(LAYOUT, torch.Generator().manual_seed(3))
    stale = _layer_bytes(random_kv(LAYOUT, torch.Generator().manual_seed(4)), 0)
    target = receiver.expect("s", LAYOUT, time.time() + 30)
    half = LAYOUT.bytes_per_layer // 2
    hold = threading.Event()
    first = _held_call(
        receiver,
        [_begin("s", target.ticket, b"a"),
         frame(KIND.FRAME_KIND_DATA, "s", layer=0, offset=0, payload=stale[:half])],
        hold,
        [frame(KIND.FRAME_KIND_DATA, "s", layer=0, offset=half, payload=stale[half:])],
    )  # fmt: skip
    assert wait_until(lambda: receiver.stats().bytes_received == half)
    sender = _sender()
    try:
        sender.begin("s", target, LAYOUT)  # BEGIN on 3 streams while the first call is open
        assert listener.wait_event("s", "restart") == (
            "restart", "sender_lost: superseded by a new attempt")  # fmt: skip
        hold.set()  # the first call's late DATA
        result = first.result(30)
        assert (result.ok, result.reason) == (False, SUPERSEDED)
        assert receiver.stats().stale_frames == 1
        assert send_all(sender, "s", kv, [7], 9).result(30).ok
    finally:
        sender.close()
    assert listener.wait_final("s") == ("complete", 9)
    assert [e for e in listener.events["s"] if e[0] == "layer"] == [("layer", i) for i in range(3)]
    _assert_delivered(listener, "s", kv)
    stats = receiver.stats()
    assert (stats.senders_lost, stats.failures, stats.bytes_received) == (
        1, {}, half + LAYOUT.total_bytes)  # fmt: skip
    assert receiver.release("s")
    assert receiver.stats().bytes_in_use == 0


def test_cancelled_call_then_nobody_retries_fails_at_the_deadline(receiver, listener):
    target = receiver.expect("d", LAYOUT, time.time() + DEADLINE_S)
    hold = threading.Event()
    call = _held_call(
        receiver,
        [_begin("d", target.ticket, b"x"),
         frame(KIND.FRAME_KIND_DATA, "d", layer=0, offset=0,
               payload=bytes(LAYOUT.bytes_per_layer))],
        hold, [],
    )  # fmt: skip
    assert wait_until(lambda: ("d", 0) in listener.layers)
    call.cancel()  # the sender goes away: the server's call breaks
    restart = listener.wait_event("d", "restart")
    assert restart[1].startswith("sender_lost: connection_lost")
    final = listener.wait_final("d")
    assert final[0] == "failed" and final[1].startswith("deadline")
    hold.set()
    assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=10)
    stats = receiver.stats()
    assert (stats.senders_lost, stats.failures, stats.unclaimed_freed) == (
        1, {"deadline": 1}, 1)  # fmt: skip


def test_a_call_that_ends_before_its_transfer_did_is_a_lost_sender(receiver, listener):
    """What a cancelled call can look like to the server (gRPC may end its request
    iterator cleanly), so a clean end mid-transfer must count as a lost sender."""
    target = receiver.expect("h", LAYOUT, time.time() + 30)
    hold = threading.Event()
    hold.set()  # no late frames: the call half-closes after its one DATA frame
    call = _held_call(
        receiver,
        [_begin("h", target.ticket, b"x"),
         frame(KIND.FRAME_KIND_DATA, "h", layer=0, offset=0,
               payload=bytes(LAYOUT.bytes_per_layer))],
        hold, [],
    )  # fmt: skip
    assert call.result(30).ok
    assert listener.wait_event("h", "restart") == (
        "restart", "sender_lost: connection_lost: the call ended before its transfer did")
    kv = random_kv(LAYOUT, torch.Generator().manual_seed(8))
    sender = _sender()
    try:
        sender.begin("h", target, LAYOUT)
        assert send_all(sender, "h", kv, [7], 3).result(30).ok
    finally:
        sender.close()
    assert listener.wait_final("h") == ("complete", 3)
    _assert_delivered(listener, "h", kv)
    assert receiver.release("h")


def test_killed_sender_process_then_another_sender_completes(receiver, listener):
    target = receiver.expect("victim", KILLABLE_LAYOUT, time.time() + 60)
    proc = start_killable_sender(target)
    try:
        assert proc.stdout.readline().strip() == "sent"
        assert wait_until(lambda: ("victim", 0) in listener.layers, timeout=30)
        proc.kill()
        proc.wait(5)
    finally:
        proc.kill()
    restart = listener.wait_event("victim", "restart")
    assert restart[1].startswith("sender_lost: connection_lost")
    kv = random_kv(KILLABLE_LAYOUT, torch.Generator().manual_seed(5))
    sender = GrpcKVSender(SenderConfig(num_streams=4, max_chunk_bytes=8192))
    try:
        sender.begin("victim", target, KILLABLE_LAYOUT)
        assert send_all(sender, "victim", kv, [100], 77).result(30).ok
    finally:
        sender.close()
    assert listener.wait_final("victim") == ("complete", 77)
    after = listener.events["victim"][listener.events["victim"].index(restart) + 1 :]
    assert after == [("layer", i) for i in range(4)] + [("complete", 77)]
    _assert_delivered(listener, "victim", kv)
    assert receiver.stats().senders_lost == 1
    assert receiver.release("victim")
    assert receiver.stats().bytes_in_use == 0
