import pytest

from kv_transfer.errors import Reason, TransferRefused
from kv_transfer.tickets import TicketAuthority

SECRET = b"s" * 32


def refused(authority, ticket, request_id, now):
    with pytest.raises(TransferRefused) as info:
        authority.verify(ticket, request_id, now)
    return info.value.code


def test_valid_ticket():
    authority = TicketAuthority(SECRET, generation=7)
    ticket = authority.issue("req-1", expiry=100.0)
    authority.verify(ticket, "req-1", now=99.9)
    assert authority.generation == 7


def test_refusals():
    authority = TicketAuthority(SECRET, generation=7)
    ticket = authority.issue("req-1", expiry=100.0)
    assert refused(authority, ticket, "req-1", now=100.1) is Reason.EXPIRED_TICKET
    assert refused(authority, ticket, "req-2", now=1.0) is Reason.WRONG_REQUEST
    restarted = TicketAuthority(SECRET, generation=8)
    assert refused(restarted, ticket, "req-1", now=1.0) is Reason.WRONG_GENERATION
    other_secret = TicketAuthority(b"x" * 32, generation=7)
    assert refused(other_secret, ticket, "req-1", now=1.0) is Reason.BAD_TICKET
    tampered = bytearray(ticket)
    tampered[12] ^= 1  # inside the expiry field
    assert refused(authority, bytes(tampered), "req-1", now=1.0) is Reason.BAD_TICKET
    assert refused(authority, ticket[:20], "req-1", now=1.0) is Reason.BAD_TICKET
    assert refused(authority, ticket + b"x", "req-1", now=1.0) is Reason.BAD_TICKET


def test_random_secrets_differ():
    a, b = TicketAuthority(), TicketAuthority()
    assert a.generation != b.generation
    assert refused(a, b.issue("r", 1e12), "r", now=1.0) is Reason.WRONG_GENERATION


def test_validation():
    with pytest.raises(ValueError, match="16 bytes"):
        TicketAuthority(b"short")
    with pytest.raises(ValueError, match="generation"):
        TicketAuthority(SECRET, generation=0)
    with pytest.raises(ValueError, match="64"):
        TicketAuthority(SECRET, 1).issue("x" * 65, 1.0)


def test_ranks_sharing_secret_and_generation_issue_the_same_ticket():
    """A decode pod's ranks each run a receiver with the pod's secret and
    generation: given the same deadline as expiry, each issues the bytes rank 0
    put into the target, and each accepts the others'."""
    ranks = [TicketAuthority(SECRET, generation=7) for _ in range(2)]
    tickets = [authority.issue("req-1", expiry=100.0) for authority in ranks]
    assert tickets[0] == tickets[1]
    ranks[1].verify(tickets[0], "req-1", now=99.0)
    ranks[0].verify(tickets[1], "req-1", now=99.0)
