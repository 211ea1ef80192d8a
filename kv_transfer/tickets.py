"""HMAC tickets: a decode pod authorises one request's KV push.

A ticket is `version | generation | expiry | request id | HMAC-SHA256` where the
MAC covers everything before it. The receiver issues it in `expect` and checks
it on every BEGIN frame (each stream authenticates itself):

1. malformed            -> bad_ticket
2. generation differs   -> wrong_generation (the ticket was issued by an earlier
                           incarnation of this pod: a stale peer, never trusted)
3. MAC differs          -> bad_ticket (constant-time comparison)
4. request id differs   -> wrong_request
5. expiry passed        -> expired_ticket

The generation is checked before the MAC so that a restarted pod, which may
have a new secret, still tells the sender precisely why it refuses.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time

from kv_transfer.errors import Reason, TransferRefused
from proto.request_id import check_request_id

TICKET_VERSION = 1
_HEAD = struct.Struct("<BQdH")  # version, generation, expiry (unix s), request id length
_MAC_BYTES = 32
MIN_SECRET_BYTES = 16


def new_generation() -> int:
    """A fresh pod generation: random, so a restart never reuses one."""
    return secrets.randbits(62) + 1


class TicketAuthority:
    """Issues and verifies tickets for one receiver incarnation. Thread-safe (immutable)."""

    __slots__ = ("_secret", "generation")

    def __init__(self, secret: bytes | None = None, generation: int | None = None) -> None:
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
            raise ValueError(f"ticket secret must be at least {MIN_SECRET_BYTES} bytes")
        if generation is not None and not 0 < generation < (1 << 63):
            raise ValueError(f"generation must be in [1, 2**63), got {generation}")
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self.generation = generation if generation is not None else new_generation()

    def issue(self, request_id: str, expiry: float) -> bytes:
        check_request_id(request_id)
        rid = request_id.encode()
        body = _HEAD.pack(TICKET_VERSION, self.generation, float(expiry), len(rid)) + rid
        return body + hmac.new(self._secret, body, hashlib.sha256).digest()

    def verify(self, ticket: bytes, request_id: str, now: float | None = None) -> None:
        """Return if `ticket` admits `request_id` now, else raise TransferRefused."""
        if len(ticket) < _HEAD.size + _MAC_BYTES:
            raise TransferRefused(Reason.BAD_TICKET, f"ticket too short ({len(ticket)} bytes)")
        version, generation, expiry, rid_len = _HEAD.unpack_from(ticket)
        if version != TICKET_VERSION or len(ticket) != _HEAD.size + rid_len + _MAC_BYTES:
            raise TransferRefused(Reason.BAD_TICKET, "malformed ticket")
        if generation != self.generation:
            raise TransferRefused(
                Reason.WRONG_GENERATION,
                f"ticket for generation {generation}, this receiver is {self.generation}",
            )
        body, mac = ticket[:-_MAC_BYTES], ticket[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self._secret, body, hashlib.sha256).digest()):
            raise TransferRefused(Reason.BAD_TICKET, "signature does not verify")
        ticket_rid = body[_HEAD.size :].decode(errors="replace")
        if ticket_rid != request_id:
            raise TransferRefused(
                Reason.WRONG_REQUEST, f"ticket is for {ticket_rid!r}, not {request_id!r}"
            )
        if (time.time() if now is None else now) > expiry:
            raise TransferRefused(Reason.EXPIRED_TICKET, f"ticket expired at {expiry:.3f}")
