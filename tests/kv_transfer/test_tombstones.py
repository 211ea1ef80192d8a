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
