"""Loopback tests of the gRPC connector: a real grpc server, real calls."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from kv_transfer.base import KVLayout
from kv_transfer.checksum import checksum
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.errors import reason_code
from kv_transfer.grpc import SERVER_OPTIONS, GrpcKVReceiver, GrpcKVSender
from kv_transfer.wire import FLAG_HEAD_RANGE, VERSION
from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.kv_transfer.helpers import (
    RecordingListener,
    random_kv,
    run_concurrent,
    send_all,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)
KIND = pdserve_pb2.FrameKind
LAYOUTS = [
    KVLayout(3, 37, 2, 16, "float32"),
    KVLayout(5, 1, 1, 8, "bfloat16"),
    KVLayout(2, 129, 3, 24, "bfloat16"),
    KVLayout(4, 65, 2, 64, "float32"),
    KVLayout(3, 21, 2, 16, "float32", token_offset=32),  # cache-miss-only: context [32, 53)
]


@pytest.fixture
def listener():
    return RecordingListener()


@pytest.fixture
def receiver(listener):
    rx = GrpcKVReceiver(ReceiverConfig(capacity_bytes=64 << 20, claim_grace_s=3.0), listener)
    rx.start()
    yield rx
    rx.close()


def make_sender(num_streams=4, **kwargs):
    return GrpcKVSender(SenderConfig(num_streams=num_streams, max_chunk_bytes=8192, **kwargs))


@pytest.mark.parametrize("num_streams", [1, 2, 4, 8])
def test_concurrent_transfers_are_byte_exact(receiver, listener, num_streams):
    sender = make_sender(num_streams)
    try:
        run_concurrent(sender, receiver, listener, LAYOUTS, seed=num_streams)
    finally:
        sender.close()


def test_xxh64_checksums_are_byte_exact(receiver, listener):
    sender = make_sender(3, checksum="xxh64")  # the default is xxh3
    try:
        run_concurrent(sender, receiver, listener, LAYOUTS[:3], seed=31)
    finally:
        sender.close()


def test_add_to_existing_server(listener):
    server = grpc.server(ThreadPoolExecutor(32), options=SERVER_OPTIONS)
    port = server.add_insecure_port("127.0.0.1:0")
    rx = GrpcKVReceiver(ReceiverConfig(capacity_bytes=1 << 20), listener)
    rx.add_to_server(server, f"127.0.0.1:{port}")
    server.start()
    rx.start()
    sender = make_sender(2)
    try:
        run_concurrent(sender, rx, listener, LAYOUTS[:2], seed=11)
    finally:
        sender.close()
        rx.close()
        server.stop(0).wait()


def test_sender_abort_and_receiver_cancel(receiver, listener):
    layout = KVLayout(4, 64, 2, 16, "float32")
    kv = random_kv(layout, torch.Generator().manual_seed(4))
    sender = make_sender()
    sender.begin("ab", receiver.expect("ab", layout, time.time() + 30), layout)
    sender.send_layer("ab", 0, kv[0], 0)
    assert wait_until(lambda: ("ab", 0) in listener.layers)
    sender.abort("ab", "client went away")
    # ABORT drops the sender's attempt; the transfer waits for another sender
    assert listener.wait_event("ab", "restart") == (
        "restart", "sender_lost: aborted: client went away")  # fmt: skip
    assert not sender.end("ab", 1).result(30).ok
    assert receiver.stats().senders_lost == 1
    assert receiver.cancel("ab", "router gave up")
    assert listener.wait_final("ab") == ("failed", "cancelled: router gave up")

    sender.begin("cx", receiver.expect("cx", layout, time.time() + 30), layout)
    sender.send_layer("cx", 0, kv[0], 0)
    assert wait_until(lambda: ("cx", 0) in listener.layers)
    assert receiver.cancel("cx", "decode pod draining")
    sender.send_layer("cx", 1, kv[1], 0)
    outcome = sender.end("cx", 1).result(30)
    assert not outcome.ok and outcome.reason == "cancelled: decode pod draining"
    assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=30)
    assert receiver.stats().failures == {"cancelled": 2}
    sender.close()


def test_refusals_reach_the_sender_with_reasons(listener):
    config = ReceiverConfig(capacity_bytes=1 << 20, secret=b"shared-secret-16", generation=5)
    receiver = GrpcKVReceiver(config, listener)
    receiver.start()
    layout = KVLayout(2, 8, 1, 8, "float32")
    kv = random_kv(layout, torch.Generator().manual_seed(7))
    # a long local grace: the receiver's refusal, not the sender's own clock, must decide
    sender = make_sender(2, verdict_grace_s=60.0)

    def push(rid, target, send_layout=layout):
        sender.begin(rid, target, send_layout)
        data = kv if send_layout == layout else random_kv(send_layout, torch.Generator())
        return reason_code(send_all(sender, rid, data, [3], 5).result(30).reason)

    try:
        target = receiver.expect("forged", layout, time.time() + 30)
        forged = target.ticket[:-1] + bytes([target.ticket[-1] ^ 1])
        assert push("forged", type(target)(target.endpoints, forged, "grpc", 5, 1e12)) == (
            "bad_ticket")  # fmt: skip
        target = receiver.expect("layout", layout, time.time() + 30)
        assert push("layout", target, KVLayout(2, 8, 1, 8, "float16")) == "layout_mismatch"
        target = receiver.expect("expired", layout, time.time() + 0.2)
        time.sleep(0.3)
        assert push("expired", target) == "expired_ticket"
        restarted = GrpcKVReceiver(
            ReceiverConfig(capacity_bytes=1 << 20, secret=b"shared-secret-16", generation=6),
            RecordingListener(),
        )
        restarted.start()
        stale = restarted.expect("stale", layout, time.time() + 30)
        restarted.close()
        stale = type(stale)(receiver.endpoints, stale.ticket, "grpc", 6, stale.deadline)
        assert push("stale", stale) == "wrong_generation"
        assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=30)
        failures = receiver.stats().failures
        assert {k: failures.get(k) for k in ("bad_ticket", "layout_mismatch",
                                             "wrong_generation")} == {  # fmt: skip
            "bad_ticket": 1, "layout_mismatch": 1, "wrong_generation": 1}  # fmt: skip
    finally:
        sender.close()
        receiver.close()


def frame(kind, rid, **fields):
    payload = fields.pop("payload", b"")
    return pdserve_pb2.KVFrame(version=VERSION, kind=kind, request_id=rid, payload=payload,
                               checksum=fields.pop("checksum", checksum(payload)), **fields)


def begin_frame(rid, layout, ticket):
    return frame(KIND.FRAME_KIND_BEGIN, rid, ticket=ticket, num_layers=layout.num_layers,
                 num_tokens=layout.num_tokens, num_kv_heads=layout.num_kv_heads,
                 head_dim=layout.head_dim, dtype=layout.dtype)  # fmt: skip


def test_bad_checksum_is_refused(receiver, listener):
    layout = KVLayout(1, 4, 1, 4, "float32")
    target = receiver.expect("cs", layout, time.time() + 30)
    stub = pdserve_pb2_grpc.KVTransferStub(grpc.insecure_channel(receiver.endpoints[0]))
    frames = [
        begin_frame("cs", layout, target.ticket),
        frame(KIND.FRAME_KIND_DATA, "cs", layer=0, offset=0, payload=b"a" * 64, checksum=1),
    ]
    result = stub.Push(iter(frames), timeout=30)
    assert (result.ok, result.reason) == (False, "bad_checksum: layer 0 offset 0")
    assert listener.wait_final("cs") == ("failed", "bad_checksum: layer 0 offset 0")
    assert receiver.stats().bytes_in_use == 0


def test_fuzzed_frames_do_not_hurt_good_transfers(receiver, listener):
    sender = make_sender(4)
    errors: list[BaseException] = []

    def good():
        try:
            run_concurrent(sender, receiver, listener, LAYOUTS, seed=21, check_pool=False)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=good)
    thread.start()
    stub = pdserve_pb2_grpc.KVTransferStub(grpc.insecure_channel(receiver.endpoints[0]))
    rng = random.Random(4242)
    for index in range(40):
        layout = KVLayout(2, rng.randint(1, 6), 1, 4, "float32")
        rid = f"fz-{index}"
        target = receiver.expect(rid, layout, time.time() + 3)
        frames = [begin_frame(rid, layout, target.ticket)] + [
            frame(KIND.FRAME_KIND_DATA, rid, layer=layer, offset=row * 16,
                  payload=rng.randbytes(16))
            for layer in range(2) for row in range(layout.rows_per_layer)
        ] + [frame(KIND.FRAME_KIND_END, rid, total_bytes=layout.total_bytes)]  # fmt: skip
        for _ in range(rng.randint(1, 4)):  # corrupt: reorder, drop, mutate, inject
            choice = rng.randrange(4)
            if choice == 0:
                rng.shuffle(frames)
            elif choice == 1 and frames:
                frames.pop(rng.randrange(len(frames)))
            elif choice == 2 and frames:
                f = frames[rng.randrange(len(frames))]
                f.offset = rng.randrange(1 << 20)
                f.layer = rng.randrange(5)
            else:
                frames.insert(rng.randrange(len(frames) + 1), frame(
                    rng.randrange(6), rng.choice([rid, "req-21-0", "nobody"]),
                    layer=rng.randrange(3), offset=rng.randrange(64),
                    payload=rng.randbytes(rng.randrange(40))))  # fmt: skip
        try:
            stub.Push(iter(frames), timeout=30)
        except grpc.RpcError:
            pass  # a deadline or an internal refusal is an acceptable answer
    thread.join(60)
    assert not errors, errors
    for index in range(40):
        receiver.release(f"fz-{index}")
    assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=30)
    run_concurrent(sender, receiver, listener, LAYOUTS[:1], seed=99)
    sender.close()


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


def test_head_fields_travel_behind_their_flag(receiver, listener):
    layout = KVLayout(1, 4, 2, 4, "float32", head_start=2, model_kv_heads=4)
    stub = pdserve_pb2_grpc.KVTransferStub(grpc.insecure_channel(receiver.endpoints[0]))
    target = receiver.expect("hf", layout, time.time() + 30)
    fields = dict(head_start=2, model_kv_heads=4, sub_start=0, sub_end=2, num_senders=1)
    unflagged = begin_frame("hf", layout, target.ticket)
    unflagged.MergeFrom(pdserve_pb2.KVFrame(**fields))  # the head fields, no flag
    result = stub.Push(iter([unflagged]), timeout=30)
    assert (result.ok, result.reason) == (
        False, "bad_frame: BEGIN head fields do not match its flags")  # fmt: skip
    target = receiver.expect("hf2", layout, time.time() + 30)
    flagged = begin_frame("hf2", layout, target.ticket)
    flagged.MergeFrom(pdserve_pb2.KVFrame(flags=FLAG_HEAD_RANGE, **fields))
    payload = bytes(layout.bytes_per_layer)
    frames = [flagged, frame(KIND.FRAME_KIND_DATA, "hf2", layer=0, offset=0, payload=payload),
              frame(KIND.FRAME_KIND_END, "hf2", first_token_id=3,
                    total_bytes=layout.total_bytes)]  # fmt: skip
    result = stub.Push(iter(frames), timeout=30)
    assert (result.ok, result.reason) == (True, "")
    assert listener.wait_final("hf2") == ("complete", 3)
    assert receiver.release("hf2")
