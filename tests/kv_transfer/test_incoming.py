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
    assert t.end(peer, 7, LAYOUT.total_bytes) and not t.end(peer, 7, LAYOUT.total_bytes)
    assert t.complete() and t.state is TransferState.COMPLETE
    assert t.tombstone() == Tombstone("", b"a")
    assert not t.fail("deadline") and t.reason == ""


def test_dropping_an_attempt_resets_progress():
    t, _ = make_incoming()
    first = Peer()
    t.start_attempt(b"a", first)
    land(t, 0)
    assert t.take_ready_layer() == 0 and t.end(first, 1, 1)
    assert t.superseded_by(b"b") and not t.superseded_by(b"a")
    assert t.runs_attempt(0)
    assert t.drop_attempt() == [first]
    assert t.state is TransferState.SENDER_LOST and not t.runs_attempt(0)
    assert (t.next_layer, t.end_peer, t.end_total, t.writes.layer_rows) == (0, None, 0, [0, 0])
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
