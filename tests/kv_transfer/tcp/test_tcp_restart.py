"""TCP connector: a transfer survives its sender (restart against the same target).

A sender that goes away before END (connection closed, killed) does not fail
the transfer: another sender's BEGIN with the same ticket restarts it from
layer 0 into the same landing buffer. A newer attempt's BEGIN supersedes a
sender that is still connected; that sender's late frames are refused.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from kv_transfer.tcp.frames import HEADER, FrameKind, control_frame, encode_begin, encode_end
from tests.kv_transfer.helpers import (
    KILLABLE_LAYOUT,
    RecordingListener,
    random_kv,
    send_all,
    start_killable_sender,
    wait_until,
)
from tests.kv_transfer.tcp.raw import RawClient, data_frame

pytestmark = pytest.mark.timeout(90)
LAYOUT = KVLayout(3, 16, 2, 8, "float32")  # 64-byte rows, 2 KiB per layer
# The deadline leaves room for a loaded CI machine: the restart must be seen before it.
DEADLINE_S = 6.0
SUPERSEDED = "superseded: sender_lost: superseded by a new attempt"


@pytest.fixture
def listener():
    return RecordingListener()


@pytest.fixture
def receiver(listener):
    rx = TcpKVReceiver(ReceiverConfig(capacity_bytes=16 << 20, claim_grace_s=1.0), listener)
    rx.start()
    yield rx
    rx.close()


def _layer_bytes(kv: torch.Tensor, layer: int) -> bytes:
    return kv[layer].contiguous().view(torch.uint8).numpy().tobytes()


def _assert_delivered(listener, rid: str, kv: torch.Tensor) -> None:
    for layer in range(kv.shape[0]):
        got = listener.layers[(rid, layer)]
        assert torch.equal(got.view(torch.uint8), kv[layer].view(torch.uint8)), layer


def test_sender_closed_mid_payload_then_second_sender_completes(receiver, listener):
    kv = random_kv(LAYOUT, torch.Generator().manual_seed(1))
    stale = random_kv(LAYOUT, torch.Generator().manual_seed(2))
    target = receiver.expect("r", LAYOUT, time.time() + 30)
    first = RawClient(receiver.endpoints[0])
    first.send(control_frame(FrameKind.BEGIN, "r", encode_begin(LAYOUT, target.ticket, b"one")))
    first.send(data_frame("r", 0, 0, _layer_bytes(stale, 0)))
    assert wait_until(lambda: ("r", 0) in listener.layers)
    frame = data_frame("r", 1, 0, _layer_bytes(stale, 1))
    first.send(frame[: HEADER.size + 700])  # cut mid-payload, then RST
    first.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    first.close()
    restart = listener.wait_event("r", "restart")
    assert restart[1].startswith("sender_lost: connection_lost: mid-payload")
    assert receiver.stats().bytes_in_use == LAYOUT.total_bytes  # the buffer is kept

    sender = TcpKVSender(SenderConfig(num_streams=3, max_chunk_bytes=4096))
    try:
        sender.begin("r", target, LAYOUT)  # the same target: endpoints + ticket
        assert send_all(sender, "r", kv, [5, 11], 42).result(30).ok
    finally:
        sender.close()
    assert listener.wait_final("r") == ("complete", 42)
    assert listener.events["r"] == [("layer", 0), restart, ("layer", 0), ("layer", 1),
                                    ("layer", 2), ("complete", 42)]  # fmt: skip
    _assert_delivered(listener, "r", kv)
    stats = receiver.stats()
    assert (stats.senders_lost, stats.completed, stats.failures) == (1, 1, {})
    assert receiver.release("r")
    assert receiver.stats().bytes_in_use == 0


def test_superseding_begin_refuses_the_first_senders_late_frames(receiver, listener):
    kv = random_kv(LAYOUT, torch.Generator().manual_seed(3))
    stale = random_kv(LAYOUT, torch.Generator().manual_seed(4))
    target = receiver.expect("s", LAYOUT, time.time() + 30)
    first, second = RawClient(receiver.endpoints[0]), RawClient(receiver.endpoints[0])
    half = LAYOUT.bytes_per_layer // 2
    first.send(control_frame(FrameKind.BEGIN, "s", encode_begin(LAYOUT, target.ticket, b"a")))
    first.send(data_frame("s", 0, 0, _layer_bytes(stale, 0)[:half]))
    assert wait_until(lambda: receiver.stats().bytes_received == half)
    # the new pod's BEGIN arrives while the first sender is still connected
    second.send(control_frame(FrameKind.BEGIN, "s", encode_begin(LAYOUT, target.ticket, b"b")))
    assert first.status() == ("s", False, SUPERSEDED)
    assert listener.wait_event("s", "restart") == ("restart", "sender_lost: superseded by a "
                                                   "new attempt")  # fmt: skip
    first.send(data_frame("s", 0, half, _layer_bytes(stale, 0)[half:]))  # late: refused
    first.send(control_frame(FrameKind.END, "s", encode_end(1, LAYOUT.total_bytes)))
    assert wait_until(lambda: receiver.stats().stale_frames == 2)
    # the first sender's attempt id can never come back
    first.send(control_frame(FrameKind.BEGIN, "s", encode_begin(LAYOUT, target.ticket, b"a")))
    assert wait_until(lambda: receiver.stats().stale_frames == 3)

    for layer in range(LAYOUT.num_layers):
        second.send(data_frame("s", layer, 0, _layer_bytes(kv, layer)))
    second.send(control_frame(FrameKind.END, "s", encode_end(9, LAYOUT.total_bytes)))
    assert second.status() == ("s", True, "")
    assert listener.wait_final("s") == ("complete", 9)
    assert [e for e in listener.events["s"] if e[0] == "layer"] == [("layer", i) for i in range(3)]
    _assert_delivered(listener, "s", kv)
    stats = receiver.stats()
    assert (stats.senders_lost, stats.failures, stats.bytes_received) == (
        1, {}, half + LAYOUT.total_bytes)  # fmt: skip
    first.close()
    second.close()
    assert receiver.release("s")
    assert receiver.stats().bytes_in_use == 0


def test_sender_lost_and_nobody_retries_fails_at_the_deadline(receiver, listener):
    target = receiver.expect("d", LAYOUT, time.time() + DEADLINE_S)
    client = RawClient(receiver.endpoints[0])
    client.send(control_frame(FrameKind.BEGIN, "d", encode_begin(LAYOUT, target.ticket, b"x")))
    client.send(data_frame("d", 0, 0, bytes(LAYOUT.bytes_per_layer)))
    assert wait_until(lambda: ("d", 0) in listener.layers)
    client.close()  # FIN between frames
    assert listener.wait_event("d", "restart")[1] == "sender_lost: connection_lost"
    final = listener.wait_final("d")
    assert final[0] == "failed" and final[1].startswith("deadline")
    # layer 0 was handed out: freed after the 1 s claim grace, unclaimed
    assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=10)
    stats = receiver.stats()
    assert (stats.senders_lost, stats.failures, stats.unclaimed_freed) == (
        1, {"deadline": 1}, 1)  # fmt: skip


def test_killed_sender_process_then_another_sender_completes(receiver, listener):
    target = receiver.expect("victim", KILLABLE_LAYOUT, time.time() + 60)
    proc = start_killable_sender(target)
    try:
        assert proc.stdout.readline().strip() == "sent"
        assert wait_until(lambda: ("victim", 0) in listener.layers, timeout=30)
        proc.kill()  # SIGKILL mid-transfer: layer 1 is incomplete, no END
        proc.wait(5)
    finally:
        proc.kill()
    restart = listener.wait_event("victim", "restart")
    assert restart[1].startswith("sender_lost: connection_lost")
    kv = random_kv(KILLABLE_LAYOUT, torch.Generator().manual_seed(5))
    sender = TcpKVSender(SenderConfig(num_streams=4, max_chunk_bytes=8192))
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
