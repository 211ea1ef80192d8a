"""proto.request_id: the one request-id rule (pods, KV senders, receivers, tickets)."""

from __future__ import annotations

import pytest

from proto.request_id import MAX_REQUEST_ID_BYTES, check_request_id


def test_the_limit_is_bytes_of_utf8():
    check_request_id("r" * MAX_REQUEST_ID_BYTES)
    check_request_id("é" * (MAX_REQUEST_ID_BYTES // 2))  # 2 bytes each: exactly 64
    with pytest.raises(ValueError) as info:
        check_request_id("r" * (MAX_REQUEST_ID_BYTES + 1))
    assert str(info.value) == "request_id is 65 bytes UTF-8, the limit is 64"
    with pytest.raises(ValueError, match="request_id is 66 bytes UTF-8, the limit is 64"):
        check_request_id("é" * 33)  # 33 characters, 66 bytes


@pytest.mark.parametrize("bad", ["", None, b"r1"])
def test_empty_or_not_a_string_is_refused(bad):
    with pytest.raises(ValueError) as info:
        check_request_id(bad)
    assert str(info.value) == f"request_id must be a non-empty string, got {bad!r}"
