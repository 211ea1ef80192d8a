import threading

import pytest

from kv_transfer.base import KVLayout
from kv_transfer.errors import Reason, TransferRefused
from kv_transfer.incoming import Incoming
from kv_transfer.landing import LandingBufferPool
from kv_transfer.tombstones import Tombstone
from kv_transfer.transfers import Transfers
from tests.kv_transfer.helpers import RecordingListener

LAYOUT = KVLayout(2, 4, 1, 2, "float32")  # row 8 bytes, 8 rows (64 bytes) per layer


class Peer:
    def __init__(self):
        self.outcomes = []

    def notify(self, request_id, outcome):
        self.outcomes.append((request_id, outcome.ok, outcome.reason))


class RaisingListener(RecordingListener):
    def on_layer_ready(self, request_id, layer, kv_view):
        raise RuntimeError("consumer bug")


def make(listener=None):
    pool = LandingBufferPool(1024, pin_memory=False)
    listener = listener or RecordingListener()
    return Transfers(threading.Lock(), listener, pool, 30.0, 8), listener, pool


def started(transfers, pool, rid="r"):
    t = Incoming(rid, LAYOUT, 1e12, pool.allocate(LAYOUT.total_bytes))
    transfers.add(t)
    peer = Peer()
    t.start_attempt(b"a", peer)
    return t, peer


def test_refusals_of_unknown_transfers_count_once_per_request():
    transfers, _, _ = make()
    for _ in range(2):
        transfers.refuse(None, TransferRefused(Reason.BAD_TICKET, "forged"), "ghost")
    assert transfers.counts.failures == {"bad_ticket": 1}
    assert transfers.tombstone("ghost") == Tombstone("bad_ticket: forged")
    with pytest.raises(TransferRefused) as info:
        transfers.authenticated("ghost", Peer())
    assert info.value.code is Reason.BAD_TICKET  # the tombstone's refusal


def test_authenticated_refuses_strangers_and_dropped_streams():
    transfers, _, pool = make()
    t, peer = started(transfers, pool)
    assert transfers.authenticated("r", peer) is t
    with pytest.raises(TransferRefused) as info:
        transfers.authenticated("r", Peer())
    assert info.value.code is Reason.UNKNOWN_REQUEST
    t.drop_attempt()
    with pytest.raises(TransferRefused) as info:
        transfers.authenticated("r", peer)
    assert info.value.code is Reason.SUPERSEDED and transfers.counts.stale_frames == 1


def test_a_raising_listener_fails_the_transfer_not_the_thread():
    transfers, listener, pool = make(RaisingListener())
    t, peer = started(transfers, pool)
    claim = t.writes.claim(t, 0, 0, 0, 64)
    t.writes.commit(claim, 0, landed=True)
    transfers.advance(t)
    reason = "cancelled: listener on_layer_ready raised"
    assert listener.wait_final("r") == ("failed", reason)
    assert peer.outcomes == [("r", False, reason)]
    assert transfers.counts.failures == {"cancelled": 1}
    assert pool.bytes_in_use == LAYOUT.total_bytes  # a layer was handed out: kept
    t.release()
    transfers.free(t)
    assert pool.bytes_in_use == 0 and transfers.get("r") is None and len(transfers) == 0
    assert transfers.tombstone("r") == Tombstone(reason)


def test_dropping_the_current_attempt_restarts_once():
    transfers, listener, pool = make()
    t, peer = started(transfers, pool)
    assert transfers.drop_current(t, "sender_lost: gone", 0)
    assert not transfers.drop_current(t, "sender_lost: gone", 0)  # no longer current
    assert listener.events["r"] == [("restart", "sender_lost: gone")]
    assert peer.outcomes == [("r", False, "superseded: sender_lost: gone")]
    assert transfers.counts.senders_lost == 1
    stats = transfers.counts.snapshot(pool, len(transfers))
    assert (stats.active_transfers, stats.senders_lost, stats.bytes_in_use) == (1, 1, 128)
