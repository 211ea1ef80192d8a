"""The request id's one rule: a non-empty string of at most
`MAX_REQUEST_ID_BYTES` bytes of UTF-8.

The limit is the TCP KV frame header's: it carries the id in a fixed
64-byte field (kv_transfer/tcp/frames.py), so a longer id could not be
sent. Every party that takes an id from outside checks it here: the pods'
request checks (pod/messages.py), the KV senders and receivers, and the
tickets that name it. Plain Python, no project imports.
"""

from __future__ import annotations

MAX_REQUEST_ID_BYTES = 64


def check_request_id(request_id: str) -> None:
    """Raise ValueError unless `request_id` is a non-empty str of at most
    `MAX_REQUEST_ID_BYTES` bytes of UTF-8 (the message names the limit)."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    size = len(request_id.encode())
    if size > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request_id is {size} bytes UTF-8, the limit is {MAX_REQUEST_ID_BYTES}")
