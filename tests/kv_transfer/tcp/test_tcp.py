"""Loopback tests of the TCP connector: real sockets, real threads."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer.base import KVLayout
from kv_transfer.checksum import FLAG_XXH3, checksum
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.errors import reason_code
from kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from kv_transfer.tcp.frames import FrameHeader, FrameKind, control_frame, encode_begin, encode_end
from tests.kv_transfer.helpers import (
    RecordingListener,
    random_kv,
    run_concurrent,
    send_all,
    wait_until,
)
from tests.kv_transfer.tcp.raw import RawClient, data_frame

pytestmark = pytest.mark.timeout(180)

ODD_LAYOUTS = [
    KVLayout(3, 37, 2, 16, "float32"),
    KVLayout(5, 1, 1, 8, "bfloat16"),
    KVLayout(2, 129, 3, 24, "bfloat16"),
    KVLayout(4, 65, 2, 64, "float32"),
    KVLayout(3, 21, 2, 16, "float32", token_offset=32),  # cache-miss-only: context [32, 53)
    KVLayout(1, 300, 1, 40, "float16"),
    KVLayout(6, 11, 4, 32, "bfloat16"),
]


@pytest.fixture
def listener():
    return RecordingListener()


@pytest.fixture
def receiver(listener):
    rx = TcpKVReceiver(ReceiverConfig(capacity_bytes=64 << 20, claim_grace_s=3.0), listener)
    rx.start()
    yield rx
    rx.close()


def make_sender(num_streams=4, **kwargs):
    return TcpKVSender(SenderConfig(num_streams=num_streams, max_chunk_bytes=8192, **kwargs))


@pytest.mark.parametrize("num_streams", [1, 2, 4, 8])
def test_concurrent_transfers_are_byte_exact(receiver, listener, num_streams):
    sender = make_sender(num_streams)
    try:
        run_concurrent(sender, receiver, listener, ODD_LAYOUTS, seed=num_streams)
        run_concurrent(sender, receiver, listener, ODD_LAYOUTS[::-1], seed=100 + num_streams)
    finally:
        sender.close()


def test_xxh64_checksums_are_byte_exact(receiver, listener):
    sender = make_sender(4, checksum="xxh64")  # the default is xxh3
    try:
        run_concurrent(sender, receiver, listener, ODD_LAYOUTS[:3], seed=31)
    finally:
        sender.close()


def test_chunks_in_any_order_reassemble(receiver, listener):
    layout = KVLayout(2, 50, 2, 8, "float32")
    kv = random_kv(layout, torch.Generator().manual_seed(3))
    sender = make_sender(3)
    target = receiver.expect("chunky", layout, time.time() + 30)
    sender.begin("chunky", target, layout)
    for layer in (1, 0):  # layer 1 first: delivery still waits for layer 0
        for a, b in ((40, 50), (0, 7), (7, 40)):
            sender.send_layer("chunky", layer, kv[layer, :, a:b], a)
    assert sender.end("chunky", 9).result(30).ok
    assert listener.wait_final("chunky") == ("complete", 9)
    assert [e for e in listener.events["chunky"] if e[0] == "layer"] == [("layer", 0), ("layer", 1)]
    for layer in range(2):
        assert torch.equal(listener.layers[("chunky", layer)], kv[layer])
    receiver.release("chunky")
    sender.close()
    assert receiver.stats().bytes_in_use == 0


def test_sender_abort_mid_transfer_then_release_frees_the_buffer(receiver, listener):
    layout = KVLayout(4, 64, 2, 16, "float32")
    kv = random_kv(layout, torch.Generator().manual_seed(4))
    sender = make_sender()
    sender.begin("ab", receiver.expect("ab", layout, time.time() + 30), layout)
    sender.send_layer("ab", 0, kv[0], 0)
    assert wait_until(lambda: ("ab", 0) in listener.layers)
    sender.abort("ab", "client went away")
    # ABORT drops the sender's attempt, not the transfer (another sender may retry)
    assert listener.wait_event("ab", "restart") == (
        "restart", "sender_lost: aborted: client went away")  # fmt: skip
    assert receiver.release("ab")  # the consumer gives up: now it fails and is freed
    assert listener.wait_final("ab") == ("failed", "cancelled: released before completion")
    assert receiver.stats().bytes_in_use == 0
    assert receiver.stats().failures == {"cancelled": 1}
    # the streams stay usable for the next transfer
    run_concurrent(sender, receiver, listener, ODD_LAYOUTS[:2], seed=5)
    sender.close()


def test_receiver_cancel_reaches_the_sender(receiver, listener):
    layout = KVLayout(4, 64, 2, 16, "float32")
    kv = random_kv(layout, torch.Generator().manual_seed(6))
    sender = make_sender()
    sender.begin("cx", receiver.expect("cx", layout, time.time() + 30), layout)
    sender.send_layer("cx", 0, kv[0], 0)
    assert wait_until(lambda: ("cx", 0) in listener.layers)
    assert receiver.cancel("cx", "decode pod shutting down")
    outcome = sender.end("cx", 1).result(30)
    assert not outcome.ok and outcome.reason == "cancelled: decode pod shutting down"
    sender.send_layer("cx", 1, kv[1], 0)  # after failure: dropped silently
    # layer 0 was handed out, so the buffer waits for release or the claim grace
    assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=30)
    assert receiver.stats().unclaimed_freed == 1
    sender.close()


def test_refusals_reach_the_sender_with_reasons(receiver, listener):
    layout = KVLayout(2, 8, 1, 8, "float32")
    kv = random_kv(layout, torch.Generator().manual_seed(7))
    # a long local grace: the receiver's refusal, not the sender's own clock, must decide
    sender = make_sender(2, verdict_grace_s=60.0)

    def push(rid, target, send_layout=layout):
        sender.begin(rid, target, send_layout)
        data = kv if send_layout == layout else random_kv(send_layout, torch.Generator())
        return send_all(sender, rid, data, [], 5).result(30)

    target = receiver.expect("bad-ticket", layout, time.time() + 30)
    forged = target.ticket[:-1] + bytes([target.ticket[-1] ^ 1])
    outcome = push("bad-ticket", type(target)(target.endpoints, forged, "tcp", 1, 1e12))
    assert reason_code(outcome.reason) == "bad_ticket"

    target = receiver.expect("layout", layout, time.time() + 30)
    outcome = push("layout", target, KVLayout(2, 8, 1, 8, "bfloat16"))
    assert reason_code(outcome.reason) == "layout_mismatch"

    target = receiver.expect("expired", layout, time.time() + 0.2)
    time.sleep(0.3)
    outcome = push("expired", target)
    assert reason_code(outcome.reason) == "expired_ticket"

    other = receiver.expect("other", layout, time.time() + 30)
    target = receiver.expect("wrong-req", layout, time.time() + 30)
    outcome = push("wrong-req", type(target)(target.endpoints, other.ticket, "tcp", 1, 1e12))
    assert reason_code(outcome.reason) == "wrong_request"
    receiver.cancel("other", "test over")
    assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=30)
    failures = receiver.stats().failures
    assert {k: failures[k] for k in ("bad_ticket", "layout_mismatch", "wrong_request")} == {
        "bad_ticket": 1, "layout_mismatch": 1, "wrong_request": 1}  # fmt: skip
    sender.close()


def test_bad_checksum_fails_transfer_and_connection_continues(receiver, listener):
    layout = KVLayout(1, 4, 1, 4, "float32")  # 16-byte rows, 128 bytes
    client = RawClient(receiver.endpoints[0])
    for rid in ("cs", "ok"):
        target = receiver.expect(rid, layout, time.time() + 30)
        client.send(control_frame(FrameKind.BEGIN, rid, encode_begin(layout, target.ticket, b"")))
    client.send(data_frame("cs", 0, 0, b"a" * 64, bad_checksum=True))
    assert client.status() == ("cs", False, "bad_checksum: layer 0 offset 0")
    client.send(data_frame("cs", 0, 64, b"b" * 64))  # refused quietly: already told
    target = receiver.expect("x3", layout, time.time() + 30)
    client.send(control_frame(FrameKind.BEGIN, "x3", encode_begin(layout, target.ticket, b"")))
    payload = b"c" * 64  # flagged XXH3 but carrying the XXH64 digest
    client.send(FrameHeader(FrameKind.DATA, "x3", 0, 0, 64, checksum(payload), FLAG_XXH3).pack()
                + payload)  # fmt: skip
    assert client.status() == ("x3", False, "bad_checksum: layer 0 offset 0")
    client.send(data_frame("ok", 0, 0, bytes(range(128))))
    client.send(control_frame(FrameKind.END, "ok", encode_end(3, 128)))
    assert client.status() == ("ok", True, "")
    assert torch.equal(listener.layers[("ok", 0)].view(torch.uint8).flatten(),
                       torch.arange(128, dtype=torch.uint8))  # fmt: skip
    receiver.release("ok")
    assert receiver.stats().bytes_in_use == 0
    client.close()


def test_restarted_receiver_refuses_old_generation(listener):
    config = ReceiverConfig(capacity_bytes=1 << 20, secret=b"shared-secret-16")
    first = TcpKVReceiver(config, listener)
    first.start()
    port = int(first.endpoints[0].rsplit(":", 1)[1])
    layout = KVLayout(2, 8, 1, 8, "float32")
    kv = random_kv(layout, torch.Generator().manual_seed(8))
    sender = make_sender(2)
    sender.begin("g1", first.expect("g1", layout, time.time() + 30), layout)
    assert send_all(sender, "g1", kv, [], 1).result(30).ok
    stale = first.expect("g2", layout, time.time() + 30)
    first.close()
    second = TcpKVReceiver(
        ReceiverConfig(capacity_bytes=1 << 20, port=port, secret=b"shared-secret-16"), listener
    )
    second.start()
    try:
        # an attempt may die with the old connections (then the sender reconnects);
        # the refusal itself must be explicit
        reasons = []
        for _ in range(3):
            sender.begin("g2", stale, layout)
            reasons.append(reason_code(send_all(sender, "g2", kv, [], 1).result(30).reason))
            if reasons[-1] != "connection_lost":
                break
        assert reasons[-1] == "wrong_generation", reasons
        sender.begin("g3", second.expect("g3", layout, time.time() + 30), layout)
        assert send_all(sender, "g3", kv, [], 1).result(30).ok
        second.release("g3")
        assert second.stats().bytes_in_use == 0
    finally:
        sender.close()
        second.close()


def test_a_sender_that_disagrees_on_the_token_offset_is_refused(receiver, listener):
    """A decode pod that holds the first 32 tokens expects only the rest; a sender
    that sends the whole context (an older prefill pod) is refused, never misplaced."""
    held = KVLayout(2, 8, 1, 8, "float32", token_offset=32)
    whole = KVLayout(2, 8, 1, 8, "float32")
    sender = make_sender(2, verdict_grace_s=60.0)
    try:
        target = receiver.expect("offset", held, time.time() + 30)
        sender.begin("offset", target, whole)
        kv = random_kv(whole, torch.Generator().manual_seed(5))
        outcome = send_all(sender, "offset", kv, [], 3).result(30)
        assert reason_code(outcome.reason) == "layout_mismatch"
        assert "decode expects 2 layers x 8 tokens from 32 x" in outcome.reason
        assert listener.wait_final("offset")[0] == "failed"
    finally:
        sender.close()
