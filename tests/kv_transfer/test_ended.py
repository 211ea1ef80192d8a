import pytest

from kv_transfer.ended import Ended, EndedTransfers
from kv_transfer.errors import Reason


def test_only_the_completing_attempt_is_recognised():
    assert Ended.of("", b"a1").completed_by_attempt(b"a1")
    assert not Ended.of("", b"a1").completed_by_attempt(b"a2")
    assert not Ended.of("", b"").completed_by_attempt(b"")  # no attempt id: never
    assert not Ended.of("deadline: passed", b"a1").completed_by_attempt(b"a1")  # failed


def test_refusals_name_how_it_ended():
    assert Ended("").refusal().code is Reason.UNKNOWN_REQUEST
    assert str(Ended("").refusal()).endswith("transfer already ended (complete)")
    refused = Ended("deadline: passed").refusal()
    assert refused.code is Reason.DEADLINE and "transfer already ended (deadline" in str(refused)


def test_memory_is_bounded_oldest_first():
    ended = EndedTransfers(2)
    for rid in ("a", "b", "c"):
        ended.remember(rid, Ended(""))
    assert "a" not in ended and ended.get("b") == Ended("") and "c" in ended
    with pytest.raises(ValueError, match="kept must be > 0"):
        EndedTransfers(0)
