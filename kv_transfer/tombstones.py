"""Tombstones: what the receive table remembers of transfers it has forgotten.

Once a transfer's buffer is freed its entry leaves the table, but frames of it
may still be in flight on other streams. A bounded memory of recently ended
transfers lets the table refuse those as "ended" (never counted as a new
failure) and let be a late BEGIN of the attempt that completed the transfer
(a stream that carried nothing: see ReceiveTable.begin).

Not thread-safe: the table calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kv_transfer.errors import Reason, TransferRefused, reason_code


@dataclass(frozen=True, slots=True)
class Tombstone:
    """How a transfer ended: `reason` ("" = complete) and, if complete, the
    attempt id that completed it."""

    reason: str
    completed_by: bytes = b""

    @classmethod
    def of(cls, reason: str, attempt: bytes) -> Tombstone:
        """How a transfer whose last attempt was `attempt` ended with `reason`."""
        return cls(reason, b"" if reason else attempt)

    def refusal(self) -> TransferRefused:
        return ended_refusal(self.reason)

    def completed_by_attempt(self, attempt: bytes) -> bool:
        return bool(attempt) and attempt == self.completed_by


def ended_refusal(reason: str) -> TransferRefused:
    """Refusal of a frame for a transfer that already ended (never counted again)."""
    code = reason_code(reason)
    return TransferRefused(
        Reason(code) if code != "other" else Reason.UNKNOWN_REQUEST,
        f"transfer already ended ({reason or 'complete'})",
    )


class Tombstones:
    """The last `kept` ended request ids, oldest forgotten first."""

    def __init__(self, kept: int) -> None:
        if kept <= 0:
            raise ValueError(f"kept must be > 0, got {kept}")
        self._kept = kept
        self._ended: OrderedDict[str, Tombstone] = OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ended

    def get(self, request_id: str) -> Tombstone | None:
        return self._ended.get(request_id)

    def remember(self, request_id: str, tombstone: Tombstone) -> None:
        self._ended[request_id] = tombstone
        if len(self._ended) > self._kept:
            self._ended.popitem(last=False)
