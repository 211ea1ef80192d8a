import pytest

from kv_transfer.base import KVLayout, TransferState
from kv_transfer.errors import InvalidTransition
from kv_transfer.incoming import Incoming
from kv_transfer.landing import LandingBufferPool
from kv_transfer.tombstones import Tombstone

LAYOUT = KVLayout(2, 4, 1, 2, "float32")  # row 8 bytes, 8 rows (64 bytes) per layer


class Peer:
    def notify(self, request_id, outcome):
        pass


def make_incoming() -> tuple[Incoming, LandingBufferPool]:
    pool = LandingBufferPool(1024, pin_memory=False)
    return Incoming("r", LAYOUT, 1e12, pool.allocate(LAYOUT.total_bytes)), pool


def land(t: Incoming, layer: int) -> None:
    claim = t.writes.claim(t, t.attempts.epoch, layer, 0, 64)
    t.writes.commit(claim, t.attempts.epoch, landed=True)


def test_layers_are_taken_in_order_then_it_completes():
    t, _ = make_incoming()
    peer = Peer()
    t.start_attempt(b"a", peer)
    assert t.state is TransferState.STARTED and t.attempts.carries(peer)
    land(t, 1)
    assert t.take_ready_layer() is None  # layer 0 first
    land(t, 0)
    assert (t.take_ready_layer(), t.take_ready_layer(), t.take_ready_layer()) == (0, 1, None)
    assert not t.complete()  # no END yet
    assert t.end(peer, 7, LAYOUT.total_bytes) == ""
    assert t.end(peer, 7, LAYOUT.total_bytes) == "second END"
    assert t.complete() and t.state is TransferState.COMPLETE
    assert t.tombstone() == Tombstone("", b"a")
    assert not t.fail("deadline") and t.reason == ""


def test_dropping_an_attempt_resets_progress():
    t, _ = make_incoming()
    first = Peer()
    t.start_attempt(b"a", first)
    land(t, 0)
    assert t.take_ready_layer() == 0 and t.end(first, 1, 1) == ""
    assert t.superseded_by(b"b") and not t.superseded_by(b"a")
    assert t.runs_attempt(0)
    assert t.drop_attempt() == [first]
    assert t.state is TransferState.SENDER_LOST and not t.runs_attempt(0)
    assert (t.next_layer, t.end_peers, t.end_total, t.writes.layer_rows) == (0, [], 0, [0, 0])
    t.start_attempt(b"b", Peer())
    assert t.state is TransferState.STARTED and t.attempts.current == b"b"
    assert t.runs_attempt(1)


def test_buffer_is_taken_only_when_its_time_came():
    t, pool = make_incoming()
    t.start_attempt(b"a", Peer())
    claim = t.writes.claim(t, 0, 0, 0, 64)
    assert t.take_buffer(0.0, 30.0) is None  # still running
    assert t.fail("cancelled") and t.finished_at > 0
    assert t.take_buffer(0.0, 30.0) is None  # a writer is inside
    t.writes.commit(claim, 0, landed=False)
    buffer, unclaimed = t.take_buffer(0.0, 30.0)  # nothing was handed out
    assert not unclaimed and t.buffer is None and t.state is TransferState.RELEASED
    pool.free(buffer)
    assert t.take_buffer(0.0, 30.0) is None


def test_a_completed_buffer_waits_for_release_or_the_grace():
    t, _ = make_incoming()
    peer = Peer()
    t.start_attempt(b"a", peer)
    for layer in range(2):
        land(t, layer)
        t.take_ready_layer()
    t.end(peer, 1, LAYOUT.total_bytes)
    assert t.complete()
    assert t.take_buffer(t.finished_at + 1, 30.0) is None
    _, unclaimed = t.take_buffer(t.finished_at + 31, 30.0)
    assert unclaimed  # the consumer never released it


def test_release_reports_whether_it_was_running():
    t, _ = make_incoming()
    assert t.release() and t.released
    assert t.expired(2e12) and not t.expired(0.0)
    t.fail("cancelled: released before completion")
    assert not t.release() and not t.expired(2e12)
    with pytest.raises(InvalidTransition):
        t.drop_attempt()  # FAILED -> SENDER_LOST is not allowed


def test_several_senders_complete_it_with_one_end_each():
    t, _ = make_incoming()
    a, b, c = Peer(), Peer(), Peer()
    head_major = LAYOUT.head_major()
    assert t.switches_form(head_major)
    t.start_attempt(b"x", a, head_major, num_senders=2)
    assert t.layout == head_major and t.expected == LAYOUT and t.num_senders == 2
    assert t.writes.layout == head_major
    assert t.joins_differently(b"x", LAYOUT, 2).startswith("a sender of this attempt sends")
    assert t.joins_differently(b"x", head_major, 3) == (
        "a sender of this attempt says 3 senders, another 2")
    assert t.joins_differently(b"x", head_major, 2) == ""
    t.start_attempt(b"x", b, head_major, num_senders=2)
    for layer in range(2):
        land(t, layer)
        t.take_ready_layer()
    assert t.end(a, 5, LAYOUT.total_bytes) == "" and t.state is TransferState.ENDING
    assert not t.complete()  # b's END is missing
    assert t.end(b, 6, LAYOUT.total_bytes) == (
        "END's first token 6 differs from another sender's 5")
    assert t.end(b, 5, LAYOUT.total_bytes) == ""
    assert t.end(c, 5, LAYOUT.total_bytes) == "END number 3 of 2 senders"
    assert t.complete() and t.end_peers == [a, b]


def test_a_dropped_attempt_leaves_the_form_for_the_next():
    t, _ = make_incoming()
    t.start_attempt(b"x", Peer(), LAYOUT.head_major(), num_senders=2)
    t.drop_attempt()
    assert t.switches_form(LAYOUT) and not t.switches_form(LAYOUT.head_major())
    t.start_attempt(b"y", Peer(), LAYOUT)
    assert t.layout == LAYOUT and t.num_senders == 1 and t.writes.layout == LAYOUT
