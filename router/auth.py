"""Optional API key check for the HTTP and gRPC front doors.

With `--api-key KEY` (or PDSERVE_API_KEY, read by the command layer) every
`/v1/*` request must carry `Authorization: Bearer KEY`, and every gRPC call
`authorization: Bearer KEY` metadata. Probes and metrics (/health, /ready,
/metrics) stay open so orchestrators need no secret. A missing or wrong key
is a 401 in OpenAI's error shape (UNAUTHENTICATED over gRPC). Called on the
event loop for each request before its body is read.
"""

from __future__ import annotations

import hmac

from router.api_error import ApiError

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class ApiKeyCheck:
    """Compares the presented bearer token with the configured key in constant time."""

    def __init__(self, api_key: str | None) -> None:
        self._key = api_key.encode() if api_key else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def check(self, authorization: str | None) -> None:
        """Raise ApiError 401 unless `authorization` is `Bearer <key>` (no-op when disabled)."""
        if self._key is None:
            return
        if not authorization:
            raise ApiError(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
