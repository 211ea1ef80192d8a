"""Errors raised by kv_transfer, and the failure reasons every transfer ends with.

`ValueError` (the caller's fault) is used as is; the classes here are the
conditions callers must tell apart: a capacity error (`BufferPoolExhausted`,
mapped to RESOURCE_EXHAUSTED by services) and a refused transfer carrying a
machine-readable `Reason`.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """Why a transfer failed. The value is what travels on the wire and what
    `pdserve_kv_transfer_failures_total{reason}` is labelled with."""

    BAD_TICKET = "bad_ticket"
    EXPIRED_TICKET = "expired_ticket"
    WRONG_GENERATION = "wrong_generation"
    WRONG_REQUEST = "wrong_request"
    LAYOUT_MISMATCH = "layout_mismatch"
    BAD_CHECKSUM = "bad_checksum"
    BAD_FRAME = "bad_frame"
    UNKNOWN_REQUEST = "unknown_request"
    DUPLICATE_DATA = "duplicate_data"
    SIZE_MISMATCH = "size_mismatch"
    DEADLINE = "deadline"
    ABORTED = "aborted"
    CANCELLED = "cancelled"
    CONNECTION_LOST = "connection_lost"
    CONNECT_FAILED = "connect_failed"
    CLOSED = "closed"
    # not failures: why an attempt was dropped (the transfer waits for another BEGIN)
    SENDER_LOST = "sender_lost"
    SUPERSEDED = "superseded"


def reason_code(reason: str) -> str:
    """The `Reason` value a reason string starts with ("aborted: client left" -> "aborted").

    Reason strings are `code` or `code: detail`; metrics key on the code only so
    that the label set stays bounded.
    """
    code = reason.split(":", 1)[0].strip()
    return code if code in _CODES else "other"


_CODES = frozenset(r.value for r in Reason)


def make_reason(code: Reason, detail: str = "") -> str:
    """`code` or `code: detail`, the form reason strings take everywhere."""
    return f"{code.value}: {detail}" if detail else code.value


_ENDED = "transfer already ended ("


def root_reason(reason: str) -> str:
    """The reason a transfer failed, given what one of its streams was told.

    A frame for a transfer that already ended is refused with the reason it
    ended with, wrapped ("bad_checksum: transfer already ended (bad_checksum:
    layer 0 offset 0)"). Whichever stream hears back first, the transfer
    failed for the inner reason, so that is what a sender reports; the form
    for a transfer that ended complete, and every other reason, is kept."""
    _, _, detail = reason.partition(": ")
    if detail.startswith(_ENDED) and detail.endswith(")"):
        inner = detail[len(_ENDED):-1]
        if inner and inner != "complete":
            return inner
    return reason


class TransferError(Exception):
    """Base class of kv_transfer's own errors."""


class BufferPoolExhausted(TransferError):
    """The landing buffer pool has no room for this transfer now (a capacity
    error: the caller should refuse the request or try another pod, not queue)."""


class TransferRefused(TransferError):
    """A frame or ticket was refused; `reason` is the full reason string."""

    def __init__(self, code: Reason, detail: str = "") -> None:
        self.code = code
        self.reason = make_reason(code, detail)
        super().__init__(self.reason)


class InvalidTransition(TransferError):
    """A transfer state machine was asked for a transition it does not allow
    (an internal invariant violation, never the peer's fault)."""
