import pytest

from kv_transfer.errors import Reason
from kv_transfer.tombstones import Tombstone, Tombstones


def test_only_the_completing_attempt_is_recognised():
    assert Tombstone.of("", b"a1").completed_by_attempt(b"a1")
    assert not Tombstone.of("", b"a1").completed_by_attempt(b"a2")
    assert not Tombstone.of("", b"").completed_by_attempt(b"")  # no attempt id: never
    assert not Tombstone.of("deadline: passed", b"a1").completed_by_attempt(b"a1")  # failed


def test_refusals_name_how_it_ended():
    assert Tombstone("").refusal().code is Reason.UNKNOWN_REQUEST
    assert str(Tombstone("").refusal()).endswith("transfer already ended (complete)")
    refused = Tombstone("deadline: passed").refusal()
    assert refused.code is Reason.DEADLINE and "transfer already ended (deadline" in str(refused)


def test_memory_is_bounded_oldest_first():
    tombstones = Tombstones(2)
    for rid in ("a", "b", "c"):
        tombstones.remember(rid, Tombstone(""))
    assert "a" not in tombstones and tombstones.get("b") == Tombstone("") and "c" in tombstones
    with pytest.raises(ValueError, match="kept must be > 0"):
        Tombstones(0)


def test_a_sender_reports_the_first_failure_not_the_late_streams_echo():
    """Of a transfer's streams, one carries the corrupted frame and another's
    next frame finds the transfer over; whichever refusal reaches the sender
    first, the transfer failed for the corruption (the flaky gRPC fault test)."""
    from kv_transfer.base import TransferOutcome
    from kv_transfer.errors import root_reason

    echo = str(Tombstone("bad_checksum: layer 0 offset 0").refusal())
    assert echo == "bad_checksum: transfer already ended (bad_checksum: layer 0 offset 0)"
    assert root_reason(echo) == "bad_checksum: layer 0 offset 0"
    assert TransferOutcome.failed(echo).reason == "bad_checksum: layer 0 offset 0"
    assert root_reason("bad_checksum: layer 0 offset 0") == "bad_checksum: layer 0 offset 0"
    ended_complete = str(Tombstone("").refusal())
    assert root_reason(ended_complete) == ended_complete  # no failure to point at
    assert root_reason("connection_lost: stream 1: StatusCode.UNAVAILABLE") == (
        "connection_lost: stream 1: StatusCode.UNAVAILABLE")
