import threading
import time

import pytest
import torch

from kv_transfer.base import KVLayout
from kv_transfer.errors import BufferPoolExhausted, Reason, TransferRefused
from kv_transfer.landing import LandingBufferPool
from kv_transfer.layout import SenderPart
from kv_transfer.receive_table import ReceiveTable
from kv_transfer.tickets import TicketAuthority
from tests.kv_transfer.helpers import RecordingListener

LAYOUT = KVLayout(3, 4, 1, 2, "float32")  # row 8 bytes, 64 bytes per layer


class Peer:
    def __init__(self):
        self.outcomes = []

    def notify(self, request_id, outcome):
        self.outcomes.append((request_id, outcome.ok, outcome.reason))


def make_table(capacity=10_000, grace=30.0):
    listener = RecordingListener()
    pool = LandingBufferPool(capacity, pin_memory=False)
    table = ReceiveTable(pool, TicketAuthority(b"k" * 16, 5), listener, transport="tcp",
                         claim_grace_s=grace)  # fmt: skip
    return table, pool, listener


def started(table, rid="r", layout=LAYOUT, deadline=None):
    target = table.expect(rid, layout, deadline or time.time() + 30, ("127.0.0.1:1",))
    peer = Peer()
    table.begin(rid, target.ticket, layout, peer)
    return peer


def write(table, peer, rid, layer, offset, data: bytes, failure=None):
    claim = table.claim(rid, peer, layer, offset, len(data))
    claim.view[:] = data
    table.commit(claim, failure)


def test_layers_delivered_in_order_and_complete():
    table, pool, listener = make_table()
    peer = started(table)
    layer_bytes = [bytes([layer]) * 64 for layer in range(3)]
    write(table, peer, "r", 2, 0, layer_bytes[2])
    write(table, peer, "r", 1, 32, layer_bytes[1][32:])
    write(table, peer, "r", 1, 0, layer_bytes[1][:32])
    assert listener.events.get("r") is None  # layer 0 still missing
    write(table, peer, "r", 0, 8, layer_bytes[0][8:])
    write(table, peer, "r", 0, 0, layer_bytes[0][:8])
    assert listener.events["r"] == [("layer", 0), ("layer", 1), ("layer", 2)]
    table.end("r", peer, 77, LAYOUT.total_bytes)
    assert listener.events["r"][-1] == ("complete", 77)
    assert peer.outcomes == [("r", True, "")]
    assert torch.equal(listener.layers[("r", 1)].view(torch.uint8).flatten(),
                       torch.full((64,), 1, dtype=torch.uint8))  # fmt: skip
    assert pool.bytes_in_use == 192
    assert table.release("r")
    assert pool.bytes_in_use == 0
    assert table.stats().completed == 1 and table.stats().bytes_received == 192


def test_refusals_fail_the_transfer_with_reason():
    table, pool, listener = make_table()
    peer = started(table)
    with pytest.raises(TransferRefused) as info:
        table.claim("r", peer, 0, 4, 8)  # not row aligned
    assert info.value.code is Reason.BAD_FRAME
    assert listener.wait_final("r")[1].startswith("bad_frame")
    assert peer.outcomes[0][:2] == ("r", False)
    assert pool.bytes_in_use == 0  # nothing was handed out: freed at once
    assert table.stats().failures == {"bad_frame": 1}


def test_duplicate_rows_and_checksum():
    table, pool, listener = make_table()
    peer = started(table, "a")
    write(table, peer, "a", 0, 0, b"x" * 16)
    with pytest.raises(TransferRefused) as info:
        table.claim("a", peer, 0, 8, 16)
    assert info.value.code is Reason.DUPLICATE_DATA
    peer_b = started(table, "b")
    write(table, peer_b, "b", 0, 0, b"y" * 64, failure="bad_checksum: layer 0")
    assert listener.wait_final("b") == ("failed", "bad_checksum: layer 0")
    assert table.stats().failures == {"duplicate_data": 1, "bad_checksum": 1}
    assert pool.bytes_in_use == 0


def test_begin_checks_ticket_and_layout():
    table, pool, _ = make_table()
    target = table.expect("r", LAYOUT, time.time() + 30, ("h:1",))
    other = KVLayout(3, 4, 1, 2, "float16")
    with pytest.raises(TransferRefused) as info:
        table.begin("r", target.ticket, other, Peer())
    assert info.value.code is Reason.LAYOUT_MISMATCH
    with pytest.raises(TransferRefused) as info:
        table.begin("zzz", target.ticket, LAYOUT, Peer())
    assert info.value.code is Reason.WRONG_REQUEST
    assert table.stats().failures == {"layout_mismatch": 1, "wrong_request": 1}
    assert pool.bytes_in_use == 0


def test_unauthenticated_peer_cannot_write():
    table, pool, _ = make_table()
    started(table)
    with pytest.raises(TransferRefused) as info:
        table.claim("r", Peer(), 0, 0, 8)
    assert info.value.code is Reason.UNKNOWN_REQUEST
    assert pool.bytes_in_use == LAYOUT.total_bytes  # the real transfer is untouched


def test_buffer_kept_while_a_writer_is_inside():
    table, pool, listener = make_table()
    peer = started(table)
    claim = table.claim("r", peer, 0, 0, 64)
    assert table.cancel("r", "client left")
    assert listener.wait_final("r") == ("failed", "cancelled: client left")
    assert peer.outcomes == [("r", False, "cancelled: client left")]
    assert pool.bytes_in_use == LAYOUT.total_bytes  # a writer still holds the region
    table.commit(claim)
    assert pool.bytes_in_use == 0
    assert not table.cancel("r", "again")


def test_deadline_and_unclaimed_buffers():
    table, pool, listener = make_table(grace=0.05)
    started(table, "late", deadline=time.time() + 0.05)
    peer = started(table, "done")
    for layer in range(3):
        write(table, peer, "done", layer, 0, b"z" * 64)
    table.end("done", peer, 1, LAYOUT.total_bytes)
    time.sleep(0.1)
    table.sweep(time.time())
    assert listener.wait_final("late")[1].startswith("deadline")
    assert pool.bytes_in_use == 0
    stats = table.stats()
    assert stats.unclaimed_freed == 1 and stats.failures == {"deadline": 1}
    assert not table.release("done")


def test_expect_back_pressure_and_validation():
    table, pool, _ = make_table(capacity=LAYOUT.total_bytes)
    table.expect("a", LAYOUT, time.time() + 30, ("h:1",))
    with pytest.raises(BufferPoolExhausted):
        table.expect("b", LAYOUT, time.time() + 30, ("h:1",))
    with pytest.raises(ValueError, match="already"):
        table.expect("a", LAYOUT, time.time() + 30, ("h:1",))
    with pytest.raises(ValueError, match="past"):
        table.expect("c", LAYOUT, time.time() - 1, ("h:1",))
    table.close()
    assert pool.bytes_in_use == 0


def test_size_mismatch_at_end():
    table, pool, listener = make_table()
    peer = started(table)
    table.end("r", peer, 1, 5)
    assert listener.wait_final("r")[1].startswith("size_mismatch")
    assert peer.outcomes[0][2].startswith("size_mismatch")
    assert pool.bytes_in_use == 0


def test_new_attempt_waits_for_a_dropped_writer_still_in_its_rows():
    table, pool, listener = make_table()
    target = table.expect("w", LAYOUT, time.time() + 30, ("127.0.0.1:1",))
    old, new = Peer(), Peer()
    table.begin("w", target.ticket, LAYOUT, old, b"old")
    stale = table.claim("w", old, 0, 0, 64)  # the old sender is mid-payload
    table.begin("w", target.ticket, LAYOUT, new, b"new")  # supersedes it
    assert old.outcomes == [("w", False, "superseded: sender_lost: superseded by a new attempt")]
    assert listener.events["w"] == [("restart", "sender_lost: superseded by a new attempt")]
    with pytest.raises(TransferRefused) as refused:
        table.claim("w", old, 1, 0, 64)  # the old stream's next frame
    assert refused.value.code is Reason.SUPERSEDED
    got: list = []
    claimer = threading.Thread(target=lambda: got.append(table.claim("w", new, 0, 0, 64)))
    claimer.start()
    claimer.join(0.3)
    assert claimer.is_alive() and not got  # rows 0..7 are still being written by `old`
    stale.view[:] = b"\xee" * 64
    table.commit(stale)  # the stale bytes never count
    claimer.join(5)
    (claim,) = got
    claim.view[:] = bytes(64)
    table.commit(claim)
    assert listener.events["w"][-1] == ("layer", 0)
    assert listener.layers[("w", 0)].view(torch.uint8).sum() == 0
    stats = table.stats()
    assert (stats.senders_lost, stats.stale_frames, stats.bytes_received) == (1, 1, 64)
    table.release("w")
    assert pool.bytes_in_use == 0


def test_sender_lost_then_deadline_fails_and_frees():
    table, pool, listener = make_table(grace=0.01)
    peer = started(table, "x", deadline=time.time() + 0.2)
    write(table, peer, "x", 0, 0, bytes(64))
    table.peer_lost(peer, "connection_lost")
    assert listener.events["x"][-1] == ("restart", "sender_lost: connection_lost")
    assert table.stats().active_transfers == 1  # waiting for another BEGIN
    time.sleep(0.25)
    table.sweep(time.time())
    assert listener.events["x"][-1][0] == "failed"
    assert listener.events["x"][-1][1].startswith("deadline")
    table.sweep(time.time() + 1)
    assert pool.bytes_in_use == 0


def test_a_late_begin_of_the_completing_attempt_is_not_a_failure():
    """A stream the sender opened but sent nothing on (a transfer smaller than its
    streams) may deliver its BEGIN after the others completed the transfer: that
    BEGIN is let be, before and after release; another attempt's is refused."""
    table, pool, listener = make_table()
    target = table.expect("late", LAYOUT, time.time() + 30, ("127.0.0.1:1",))
    carrier, idle, other = Peer(), Peer(), Peer()
    table.begin("late", target.ticket, LAYOUT, carrier, b"attempt-1")
    for layer in range(3):
        write(table, carrier, "late", layer, 0, bytes(64))
    table.end("late", carrier, 5, LAYOUT.total_bytes)
    assert listener.wait_final("late") == ("complete", 5)
    table.begin("late", target.ticket, LAYOUT, idle, b"attempt-1")  # no exception
    with pytest.raises(TransferRefused, match="transfer already ended"):
        table.begin("late", target.ticket, LAYOUT, other, b"attempt-2")
    assert table.release("late")
    table.begin("late", target.ticket, LAYOUT, idle, b"attempt-1")  # still none
    with pytest.raises(TransferRefused, match="transfer already ended"):
        table.begin("late", target.ticket, LAYOUT, other, b"attempt-2")
    assert carrier.outcomes == [("late", True, "")] and idle.outcomes == []
    assert table.stats().failures == {} and pool.bytes_in_use == 0


def test_deadline_per_phase_waiting_for_a_sender_does_not_use_the_transfer_timeout():
    table, _, listener = make_table()
    now = time.time()
    target = table.expect("q", LAYOUT, now + 60, ("127.0.0.1:1",), transfer_timeout_s=0.5)
    assert target.deadline == now + 60  # the ticket outlives a queued prefill
    table.sweep(now + 5)  # queued at the prefill pod far past the transfer timeout
    assert "q" not in listener.events
    peer = Peer()
    table.begin("q", target.ticket, LAYOUT, peer)  # the prefill starts: its clock starts
    begun = time.time()
    assert begun + 0.5 == pytest.approx(table.deadline_of("q"), abs=0.05)
    table.peer_lost(peer, "connection_lost")  # waiting for a sender again: no transfer clock
    assert table.deadline_of("q") == now + 60
    table.sweep(begun + 5)
    assert listener.events["q"][-1][0] == "restart"
    second = Peer()
    table.begin("q", target.ticket, LAYOUT, second, attempt=b"2")
    table.sweep(time.time() + 1)  # the new attempt's 0.5 s passed
    assert listener.wait_final("q") == (
        "failed", "deadline: the transfer did not finish within the 0.5s transfer timeout "
                  "of its BEGIN")


def test_deadline_per_phase_no_sender_by_the_reservation_deadline():
    table, _, listener = make_table()
    deadline = time.time() + 60
    table.expect("n", LAYOUT, deadline, ("127.0.0.1:1",), transfer_timeout_s=0.5)
    table.sweep(deadline + 0.1)
    assert listener.wait_final("n") == (
        "failed", f"deadline: no sender began before the reservation's deadline {deadline:.3f}")
    with pytest.raises(ValueError, match="transfer_timeout_s must be > 0 seconds, got 0"):
        table.expect("z", LAYOUT, deadline, ("127.0.0.1:1",), transfer_timeout_s=0)


def test_an_attempt_in_the_head_major_form_waits_for_the_dropped_writer():
    """A TP=1 prefill's attempt (whole-model rows) is superseded by a TP=2 prefill
    pod's (head-major rows of the same bytes) while its writer is inside: the
    new BEGIN waits for that writer to leave, then counts rows its own way."""
    layout = KVLayout(1, 4, 2, 2, "float32")  # whole-model: 16-byte rows, 64 bytes
    table, pool, listener = make_table()
    target = table.expect("f", layout, time.time() + 30, ("127.0.0.1:1",))
    old = Peer()
    table.begin("f", target.ticket, layout, old, b"tp1")
    claim = table.claim("f", old, 0, 0, 32)  # the old writer is inside
    ranks = [Peer(), Peer()]
    head_major = layout.head_major()
    began = threading.Event()

    def begin_first_rank():
        table.begin("f", target.ticket, head_major, ranks[0], b"tp2", SenderPart(0, 1, 2))
        began.set()

    thread = threading.Thread(target=begin_first_rank)
    thread.start()
    assert not began.wait(0.3)  # waiting for the old writer
    table.commit(claim)  # it leaves (its attempt was dropped: nothing counts)
    assert began.wait(5)
    thread.join()
    assert old.outcomes[0][1:] == (False, "superseded: sender_lost: superseded by a new "
                                          "attempt")  # fmt: skip
    table.begin("f", target.ticket, head_major, ranks[1], b"tp2", SenderPart(1, 2, 2))
    kv = torch.arange(32, dtype=torch.float32).view(2, 4, 2, 2)  # [2, T, H, D]
    staged = kv.permute(2, 0, 1, 3).contiguous().view(torch.uint8).flatten()  # head-major
    write(table, ranks[1], "f", 0, 32, bytes(staged[32:].tolist()))
    write(table, ranks[0], "f", 0, 0, bytes(staged[:32].tolist()))
    table.end("f", ranks[0], 9, layout.total_bytes)
    assert listener.events["f"][-1] == ("layer", 0)  # one END of two
    table.end("f", ranks[1], 9, layout.total_bytes)
    assert listener.events["f"][-1] == ("complete", 9)
    assert [p.outcomes for p in ranks] == [[("f", True, "")]] * 2
    assert torch.equal(listener.layers[("f", 0)], kv)
    assert table.release("f") and pool.bytes_in_use == 0
