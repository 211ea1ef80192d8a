"""Head-ranged transfers on loopback, both connectors: several senders (one per
prefill rank) filling one decode rank's layout, one sender's heads split over
two decode ranks, refusals, and a sender lost or superseded mid-attempt."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer.base import KVLayout, KVReceiver, KVSender, RankTarget, TransferTarget
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.errors import reason_code
from kv_transfer.grpc import GrpcKVReceiver, GrpcKVSender
from kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from kv_transfer.tp_plan import send_plan, senders_of, sends_of
from tests.kv_transfer.helpers import RecordingListener, random_kv, wait_until

pytestmark = pytest.mark.timeout(180)
SECRET = b"s" * 32
GENERATION = 7
# 4 KV heads; decode rank d of 2 holds heads [2d, 2d + 2)
WHOLE = KVLayout(3, 37, 4, 16, "float32")


@pytest.fixture(params=["tcp", "grpc"])
def transport(request):
    return request.param


@pytest.fixture
def listener():
    return RecordingListener()


def make_receiver(transport: str, listener: RecordingListener) -> KVReceiver:
    config = ReceiverConfig(capacity_bytes=32 << 20, claim_grace_s=3.0, secret=SECRET,
                            generation=GENERATION)  # fmt: skip
    rx = (TcpKVReceiver if transport == "tcp" else GrpcKVReceiver)(config, listener)
    rx.start()
    return rx


def make_sender(transport: str, num_streams: int = 3) -> KVSender:
    config = SenderConfig(num_streams=num_streams, max_chunk_bytes=4096)
    return (TcpKVSender if transport == "tcp" else GrpcKVSender)(config)


@pytest.fixture
def receiver(transport, listener):
    rx = make_receiver(transport, listener)
    yield rx
    rx.close()


@pytest.fixture
def senders(transport):
    made = [make_sender(transport) for _ in range(3)]
    yield made
    for sender in made:
        sender.close()


def send_part(sender: KVSender, rid: str, kv: torch.Tensor, heads: tuple[int, int],
              cuts: list[int], layers: range | None = None) -> None:  # fmt: skip
    """Send heads [s, e) (layout-local) of `kv` [L, 2, T, H, D], each layer in token
    chunks split at `cuts`, as one prefill rank does."""
    s, e = heads
    bounds = [0, *cuts, kv.shape[2]]
    for layer in layers if layers is not None else range(kv.shape[0]):
        for a, b in zip(bounds, bounds[1:], strict=False):
            sender.send_layer(rid, layer, kv[layer, :, a:b, s:e].clone(), a)


def assert_landed(listener: RecordingListener, rid: str, kv: torch.Tensor) -> None:
    for layer in range(kv.shape[0]):
        got = listener.layers[(rid, layer)]
        assert got.shape == kv[layer].shape
        assert torch.equal(got.view(torch.uint8), kv[layer].view(torch.uint8))


@pytest.mark.parametrize("decode_layout", [WHOLE.head_share(0, 2), WHOLE.head_share(2, 4)],
                         ids=["heads-0-2", "heads-2-4"])
def test_two_senders_fill_one_decode_layout(receiver, listener, senders, decode_layout):
    """Prefill TP=4 -> decode TP=2 (heads split 1 + 1): two prefill ranks write
    heads [0, 1) and [1, 2) of one decode rank's layout, one attempt id."""
    kv = random_kv(decode_layout, torch.Generator().manual_seed(1))
    target = receiver.expect("two", decode_layout, time.time() + 60)
    for i, heads in enumerate([(0, 1), (1, 2)]):
        senders[i].begin("two", target, decode_layout, heads=heads, attempt=b"shared01",
                         num_senders=2)  # fmt: skip
    send_part(senders[1], "two", kv, (1, 2), [10, 30])
    send_part(senders[0], "two", kv, (0, 1), [])
    first = senders[0].end("two", 42)
    assert not wait_until(first.done, timeout=0.5)  # the other sender's END is missing
    second = senders[1].end("two", 42)
    assert first.result(30).ok and second.result(30).ok
    assert listener.wait_final("two") == ("complete", 42)
    assert [e for e in listener.events["two"] if e[0] == "layer"] == [("layer", i)
                                                                       for i in range(3)]
    assert_landed(listener, "two", kv)
    assert receiver.release("two")
    assert receiver.stats().bytes_in_use == 0


def test_ranks_of_a_tp2_prefill_fill_a_tp1_decode_pod(receiver, listener, senders):
    """Prefill TP=2 -> decode TP=1: the decode pod expects the whole-model layout,
    the prefill ranks send its head-major form, heads [0, 2) and [2, 4)."""
    kv = random_kv(WHOLE, torch.Generator().manual_seed(2))
    target = receiver.expect("tp1", WHOLE, time.time() + 60)
    plan = send_plan(4, 2, 1)
    for sub in senders_of(plan, 0):
        heads = (sub.head_start, sub.head_end)
        senders[sub.prefill_rank].begin("tp1", target, WHOLE.head_major(), heads=heads,
                                        attempt=b"r0", num_senders=2)  # fmt: skip
        send_part(senders[sub.prefill_rank], "tp1", kv, heads, [5])
    futures = [senders[p].end("tp1", 9) for p in range(2)]
    assert all(f.result(30).ok for f in futures)
    assert listener.wait_final("tp1") == ("complete", 9)
    assert_landed(listener, "tp1", kv)
    assert receiver.release("tp1")


def test_one_sender_feeds_two_decode_ranks(transport, senders):
    """Prefill TP=1 -> decode TP=2: the ranks share secret and generation, so rank
    0's ticket is every rank's; the prefill rank sends each its heads."""
    listeners = [RecordingListener(), RecordingListener()]
    ranks = [make_receiver(transport, lst) for lst in listeners]
    try:
        deadline = time.time() + 60
        layouts = [WHOLE.head_share(0, 2), WHOLE.head_share(2, 4)]
        targets = [rx.expect("split", lay, deadline) for rx, lay in zip(ranks, layouts,
                                                                        strict=True)]
        assert targets[0].ticket == targets[1].ticket  # the same bytes on every rank
        target = TransferTarget(
            targets[0].endpoints, targets[0].ticket, transport, GENERATION, deadline,
            ranks=tuple(RankTarget(t.endpoints, lay.head_start,
                                   lay.head_start + lay.num_kv_heads)
                        for t, lay in zip(targets, layouts, strict=True)),
            tensor_parallel_size=2)  # fmt: skip
        kv = random_kv(WHOLE, torch.Generator().manual_seed(3))
        futures = []
        for i, sub in enumerate(sends_of(send_plan(4, 1, 2), 0)):
            rank = target.ranks[sub.decode_rank]
            layout = layouts[sub.decode_rank]
            # one sender per decode rank: a sender keys its transfers by request id
            sender = senders[i]
            sender.begin("split", target.for_rank(sub.decode_rank), layout)
            send_part(sender, "split", kv[:, :, :, rank.head_start : rank.head_end], (0, 2),
                      [20])  # fmt: skip
            futures.append(sender.end("split", 5))
        assert all(f.result(30).ok for f in futures)
        for d in range(2):
            assert listeners[d].wait_final("split") == ("complete", 5)
            assert_landed(listeners[d], "split", kv[:, :, :, 2 * d : 2 * d + 2])
    finally:
        for rx in ranks:
            rx.close()


def test_a_mismatched_layout_is_refused_naming_both_sides(receiver, listener, senders):
    expected = WHOLE.head_share(0, 2)
    target = receiver.expect("bad", expected, time.time() + 60)
    sent = KVLayout(3, 37, 3, 16, "float32", head_start=0, model_kv_heads=4)
    senders[0].begin("bad", target, sent, heads=(0, 3), attempt=b"a", num_senders=1)
    send_part(senders[0], "bad", random_kv(sent, torch.Generator().manual_seed(4)), (0, 3), [])
    outcome = senders[0].end("bad", 1).result(30)
    assert reason_code(outcome.reason) == "layout_mismatch"
    assert ("prefill sends 3 layers x 37 tokens from 0 x KV heads [0, 3) of 4 x 16 float32, "
            "decode expects 3 layers x 37 tokens from 0 x KV heads [0, 2) of 4 x 16 float32"
            ) in outcome.reason
    assert listener.wait_final("bad")[0] == "failed"
    assert not any(e[0] == "layer" for e in listener.events["bad"])


def test_senders_disagreeing_on_their_number_are_refused(receiver, listener, senders):
    layout = WHOLE.head_share(0, 2)
    target = receiver.expect("count", layout, time.time() + 60)
    senders[0].begin("count", target, layout, heads=(0, 1), attempt=b"a", num_senders=2)
    send_part(senders[0], "count", random_kv(layout, torch.Generator()), (0, 1), [],
              range(1))  # fmt: skip
    assert wait_until(lambda: receiver.stats().bytes_received > 0)  # its BEGIN is in
    senders[1].begin("count", target, layout, heads=(1, 2), attempt=b"a", num_senders=3)
    outcome = senders[1].end("count", 1).result(30)
    assert reason_code(outcome.reason) == "layout_mismatch"
    assert "says 3 senders, another 2" in outcome.reason
    assert listener.wait_final("count")[0] == "failed"


def test_a_new_attempt_supersedes_a_running_one(receiver, listener, senders):
    """Rank 0 of a first prefill pod began and sent layer 0; a retry (two senders,
    a new attempt id) supersedes it and completes the transfer."""
    layout = WHOLE.head_share(0, 2)
    kv = random_kv(layout, torch.Generator().manual_seed(6))
    target = receiver.expect("retry", layout, time.time() + 60)
    senders[2].begin("retry", target, layout, heads=(0, 1), attempt=b"old", num_senders=2)
    send_part(senders[2], "retry", kv, (0, 1), [], range(1))
    assert wait_until(lambda: receiver.stats().bytes_received > 0)
    for i, heads in enumerate([(0, 1), (1, 2)]):
        senders[i].begin("retry", target, layout, heads=heads, attempt=b"new", num_senders=2)
        send_part(senders[i], "retry", kv, heads, [7])
    futures = [senders[i].end("retry", 3) for i in range(2)]
    assert all(f.result(30).ok for f in futures)
    old = senders[2].end("retry", 3).result(30)
    assert reason_code(old.reason) in ("superseded", "connection_lost")
    assert listener.wait_final("retry") == ("complete", 3)
    assert listener.wait_event("retry", "restart")[1].startswith("sender_lost")
    assert_landed(listener, "retry", kv)
    assert receiver.stats().senders_lost == 1


def test_a_lost_sender_restarts_the_attempt_of_all(receiver, listener, senders, transport):
    """One of two senders goes away mid-transfer (its pod's sender closes: TCP
    connections drop, gRPC calls abort): the attempt is dropped, the other
    sender learns it at its END, and a new attempt of both completes it."""
    layout = WHOLE.head_share(2, 4)
    kv = random_kv(layout, torch.Generator().manual_seed(8))
    target = receiver.expect("lost", layout, time.time() + 60)
    gone = make_sender(transport)
    senders[0].begin("lost", target, layout, heads=(0, 1), attempt=b"x", num_senders=2)
    gone.begin("lost", target, layout, heads=(1, 2), attempt=b"x", num_senders=2)
    send_part(senders[0], "lost", kv, (0, 1), [])
    send_part(gone, "lost", kv, (1, 2), [], range(1))
    survivor = senders[0].end("lost", 4)
    assert wait_until(lambda: receiver.stats().bytes_received >= 4 * layout.bytes_per_layer // 2)
    gone.close()
    assert not survivor.result(30).ok  # its attempt was dropped under it
    assert listener.wait_event("lost", "restart")[1].startswith("sender_lost")
    for i, heads in enumerate([(0, 1), (1, 2)], start=1):
        senders[i].begin("lost", target, layout, heads=heads, attempt=b"y", num_senders=2)
        send_part(senders[i], "lost", kv, heads, [11])
    futures = [senders[i].end("lost", 4) for i in (1, 2)]
    assert all(f.result(30).ok for f in futures)
    assert listener.wait_final("lost") == ("complete", 4)
    assert_landed(listener, "lost", kv)


def test_begin_refuses_parts_a_layout_cannot_have(senders, receiver):
    target = receiver.expect("shape", WHOLE, time.time() + 60)
    with pytest.raises(ValueError, match="only a head-ranged layout"):
        senders[0].begin("shape", target, WHOLE, heads=(0, 2))
    with pytest.raises(ValueError, match="only a head-ranged layout"):
        senders[0].begin("shape", target, WHOLE, num_senders=2)
    with pytest.raises(ValueError, match="attempt must be"):
        senders[0].begin("shape", target, WHOLE, attempt=b"x" * 17)
    ranged = WHOLE.head_major()
    senders[0].begin("shape", target, ranged, heads=(1, 3), num_senders=2)
    with pytest.raises(ValueError, match=r"shape \[2, n, 2, 16\]"):
        senders[0].send_layer("shape", 0, torch.zeros(2, 37, 4, 16), 0)
