"""Refusals at a KV receiver's port, counted by reason for /metrics.

A refusal is one frame or one connection the receiver would not take. Each is
handled as before (a STATUS frame back, or the connection closed, and a log
line); the count is what an operator watches and alerts on:
`pdserve_kv_port_refusals_total{role, reason}` (decode_service/receiver_metrics.py).

Reasons, a bounded label set:

* an untrustworthy header, the connection is closed (`PortRefusal`):
  `bad_magic`, `bad_version`, `bad_kind`, `oversized_length`, `bad_request_id`;
* a refused frame, the connection stays in sync: the `kv_transfer.errors.Reason`
  it was refused with (`bad_ticket`, `expired_ticket`, `wrong_generation`,
  `bad_checksum`, `layout_mismatch`, `bad_frame`, `unknown_request`, ... ; the
  last also counts late frames of a transfer that was cancelled or failed);
* a connection cut off (`PortRefusal`): `stalled` (a frame not complete within
  the receiver's `io_timeout_s` of its first byte: a peer trickling bytes), and
  `connection_limit` (authenticated over `max_connections` and closed at once);
* before a TCP connection authenticated (kv_transfer/tcp/lobby.py): `not_begin`
  (its first frame was not BEGIN), `auth_timeout` (no first frame within
  `auth_timeout_s`), `pending_limit` (the oldest waiting one, dropped for a
  new one over `max_pending`), `peer_limit` (over `max_pending_per_peer` from
  one address); a BEGIN whose ticket fails counts its reason as above;
* KV TLS (kv_transfer/tcp/tls.py): `tls`, a failed or mismatched TLS
  handshake (no or a bad client certificate, plaintext on a TLS port, a TLS
  handshake on a plaintext port).

`add` is called from the receiver's connection and accept threads, `snapshot`
from the metrics thread at scrape time.
"""

from __future__ import annotations

import enum
import threading


class PortRefusal(enum.StrEnum):
    """Refusal reasons of the port itself (frame refusals use `errors.Reason`)."""

    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    BAD_KIND = "bad_kind"
    OVERSIZED_LENGTH = "oversized_length"
    BAD_REQUEST_ID = "bad_request_id"
    STALLED = "stalled"
    CONNECTION_LIMIT = "connection_limit"
    # before a connection authenticated (kv_transfer/tcp/lobby.py)
    NOT_BEGIN = "not_begin"
    AUTH_TIMEOUT = "auth_timeout"
    PENDING_LIMIT = "pending_limit"
    PEER_LIMIT = "peer_limit"
    TLS = "tls"  # KV TLS: a failed or mismatched handshake (kv_transfer/tcp/tls.py)


class RefusalCounts:
    """Refusals by reason since the receiver started; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
