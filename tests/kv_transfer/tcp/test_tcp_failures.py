"""TCP connector under failure: killed senders, abrupt closes, fuzzed frames."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch

from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from kv_transfer.tcp.frames import (
    HEADER,
    FrameHeader,
    FrameKind,
    control_frame,
    encode_begin,
    encode_end,
)
from tests.kv_transfer.helpers import (
    RecordingListener,
    random_kv,
    run_concurrent,
    wait_until,
)
from tests.kv_transfer.tcp.raw import RawClient, data_frame

pytestmark = pytest.mark.timeout(180)



@pytest.fixture
def listener():
    return RecordingListener()


@pytest.fixture
def receiver(listener):
    rx = TcpKVReceiver(ReceiverConfig(capacity_bytes=64 << 20, claim_grace_s=3.0), listener)
    rx.start()
    yield rx
    rx.close()


def test_abrupt_close_mid_payload(receiver, listener):
    layout = KVLayout(1, 64, 1, 16, "float32")
    target = receiver.expect("cut", layout, time.time() + 30)
    client = RawClient(receiver.endpoints[0])
    client.send(control_frame(FrameKind.BEGIN, "cut", encode_begin(layout, target.ticket, b"")))
    frame = data_frame("cut", 0, 0, bytes(4096))
    client.send(frame[: HEADER.size + 1000])
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    client.close()  # RST
    # the sender is lost, not the transfer: it waits for another sender's BEGIN
    restart = listener.wait_event("cut", "restart")
    assert restart[1].startswith("sender_lost: connection_lost: mid-payload")
    assert receiver.cancel("cut", "test over")
    assert listener.wait_final("cut") == ("failed", "cancelled: test over")
    assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=30)


def _fuzz_case(rng: random.Random, receiver: TcpKVReceiver, index: int,
               good_ids: list[str]) -> None:  # fmt: skip
    """One connection of hostile input; the shape of the hostility is drawn from rng."""
    layout = KVLayout(2, rng.randint(1, 9), 1, 4, "float32")  # 16-byte rows
    rid = f"fz-{index}"
    target = receiver.expect(rid, layout, time.time() + 3)
    begin = control_frame(FrameKind.BEGIN, rid, encode_begin(layout, target.ticket, b""))
    frames = [begin]
    for layer in range(layout.num_layers):
        for row in range(layout.rows_per_layer):
            frames.append(data_frame(rid, layer, row * 16, rng.randbytes(16)))
    frames.append(control_frame(FrameKind.END, rid, encode_end(0, layout.total_bytes)))
    kind = rng.randrange(6)
    if kind == 0:  # raw garbage
        stream = rng.randbytes(rng.randint(0, 400))
    elif kind == 1:  # reordered valid frames, truncated somewhere
        rng.shuffle(frames)
        stream = b"".join(frames)
        stream = stream[: rng.randint(0, len(stream))]
    elif kind == 2:  # valid frames with corrupted bytes
        raw = bytearray(b"".join(frames))
        for _ in range(rng.randint(1, 5)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        stream = bytes(raw)
    elif kind == 3:  # well-formed headers with random fields
        stream = b"".join(
            FrameHeader(FrameKind(rng.randint(1, 5)), rng.choice([rid, *good_ids, "x"]),
                        rng.randrange(4), rng.randrange(256), rng.randrange(64),
                        rng.getrandbits(64)).pack() + rng.randbytes(rng.randrange(64))
            for _ in range(rng.randint(1, 6))
        )  # fmt: skip
    elif kind == 4:  # DATA for someone else's transfer, never authenticated here
        stream = b"".join(data_frame(g, 0, 0, rng.randbytes(32)) for g in good_ids)
    else:  # a valid prefix then garbage
        stream = b"".join(frames[: rng.randint(1, len(frames))]) + rng.randbytes(50)
    client = RawClient(receiver.endpoints[0])
    try:
        client.send(stream)
    except OSError:
        pass  # the receiver may close on us first: that is a valid answer
    client.close()


def test_fuzzed_frames_do_not_hurt_good_transfers(receiver, listener):
    sender = TcpKVSender(SenderConfig(num_streams=4, max_chunk_bytes=8192))
    good_layouts = [KVLayout(6, 97, 2, 32, "bfloat16")] * 3
    good_error: list[BaseException] = []

    def good() -> None:
        try:
            for seed in range(3):
                run_concurrent(sender, receiver, listener, good_layouts, seed, check_pool=False)
        except BaseException as exc:  # surfaced below
            good_error.append(exc)

    thread = threading.Thread(target=good)
    thread.start()
    rng = random.Random(20261121)
    good_ids = [f"req-0-{i}" for i in range(3)]
    for index in range(80):
        _fuzz_case(rng, receiver, index, good_ids)
    thread.join(60)
    assert not good_error, good_error
    # every fuzz transfer ends (complete, refused, or past its 3 s deadline) and is freed
    for index in range(80):
        receiver.release(f"fz-{index}")
    assert wait_until(lambda: receiver.stats().bytes_in_use == 0, timeout=30)
    # and the receiver still works
    run_concurrent(sender, receiver, listener, [KVLayout(2, 5, 1, 8, "float32")], seed=99)
    sender.close()


def test_fuzz_is_seeded(receiver):
    """The same seed draws the same hostile streams (so a failure can be replayed)."""
    a, b = random.Random(7), random.Random(7)
    assert [a.randrange(6) for _ in range(20)] == [b.randrange(6) for _ in range(20)]
    assert random_kv(KVLayout(1, 2, 1, 2, "float32"), torch.Generator().manual_seed(1)).shape == (
        1, 2, 2, 1, 2)  # fmt: skip


def test_sender_that_never_reads_status_is_cut_off(receiver, listener):
    """Refusals are answered with STATUS frames; a peer that never reads them must
    get its connection closed, not block a receiver thread."""
    client = RawClient(receiver.endpoints[0])
    closed = False
    started = time.monotonic()
    for i in range(200_000):  # each frame names a new unknown request: one STATUS each
        try:
            client.send(data_frame(f"ghost-{i}", 0, 0, b""))
        except OSError:
            closed = True
            break
    client.close()
    assert closed
    # at once (the send buffer filled up), not after the 10 s io_timeout of a blocked send
    assert time.monotonic() - started < 5.0
    # the receiver is unharmed
    sender = TcpKVSender(SenderConfig(num_streams=2))
    run_concurrent(sender, receiver, listener, [KVLayout(2, 5, 1, 8, "float32")], seed=77)
    sender.close()


def test_a_status_to_a_sender_whose_socket_is_already_closed_is_dropped_quietly():
    """A failed STATUS closes the connection's socket; a later verdict for the
    same connection (the reader thread dropping the lost sender's transfer,
    seen in a clean-clone run) finds no descriptor. It is dropped, not
    raised (ValueError from poll) in whichever thread notifies."""
    from kv_transfer.base import TransferOutcome, Verdict
    from kv_transfer.refusals import RefusalCounts
    from kv_transfer.tcp.receiver import _Connection

    ours, theirs = socket.socketpair()
    try:
        conn = _Connection(ours, table=None, stop=threading.Event(),
                           refusals=RefusalCounts(), frame_timeout_s=1.0)
        ours.close()  # as close_quietly leaves it after a failed write
        conn.notify("r-1", TransferOutcome(Verdict.FAILED, "sender_lost: gone"))
        conn.notify("r-2", TransferOutcome(Verdict.COMPLETE))
    finally:
        theirs.close()
