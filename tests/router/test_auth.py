"""API key check: 401 shapes for missing and wrong keys."""

from __future__ import annotations

import pytest

from router.api_error import ApiError
from router.auth import ApiKeyCheck


def test_disabled_accepts_anything():
    check = ApiKeyCheck(None)
    assert not check.enabled
    check.check(None)
    check.check("Bearer whatever")


def test_missing_and_wrong_keys():
    check = ApiKeyCheck("s3cret")
    check.check("Bearer s3cret")
    check.check("bearer s3cret")
    with pytest.raises(ApiError) as missing:
        check.check(None)
    assert missing.value.status == 401
    assert missing.value.body() == {"error": {
        "message": "Missing API key: send it as 'Authorization: Bearer <key>'",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    for bad in ("Bearer nope", "Basic s3cret", "s3cret"):
        with pytest.raises(ApiError) as wrong:
            check.check(bad)
        assert (wrong.value.status, wrong.value.message) == (401, "Incorrect API key provided")
