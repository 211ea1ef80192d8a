"""Optional API key check for the HTTP and gRPC front doors.

Keys come from `--api-key KEY` (or PDSERVE_API_KEY, read by the command
layer: one key named "default") or `--api-keys-file PATH` (named keys with
their own limits, reloaded when the file changes: router/api_keys.py).
With either, every `/v1/*` request must carry `Authorization: Bearer KEY`,
and every gRPC call `authorization: Bearer KEY` metadata. Probes and
metrics (/health, /ready, /metrics) stay open so orchestrators need no
secret. A missing or unknown key is a 401 in OpenAI's error shape
(UNAUTHENTICATED over gRPC). Called on the event loop for each request
before its body is read.
"""

from __future__ import annotations

from collections.abc import Callable

from router.api_error import ApiError
from router.api_keys import ApiKey, KeyRing

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class ApiKeyCheck:
    """Finds the presented bearer token among the keys in force (by SHA-256
    digest). `keys`: None (no check), a fixed `KeyRing`, or a callable that
    returns the ring in force now (a reloading `KeyFile`'s)."""

    def __init__(self, keys: KeyRing | Callable[[], KeyRing] | str | None) -> None:
        if isinstance(keys, str):
            keys = KeyRing.single(keys)
        if isinstance(keys, KeyRing):
            ring = keys
            keys = lambda: ring  # noqa: E731 - a fixed ring
        self._keys = keys

    @property
    def enabled(self) -> bool:
        return self._keys is not None

    def check(self, authorization: str | None) -> ApiKey | None:
        """The key `authorization` (`Bearer <key>`) presents; ApiError 401 when
        it presents none or an unknown one. None when no key is checked."""
        if self._keys is None:
            return None
        if not authorization:
            raise ApiError(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        scheme, _, token = authorization.partition(" ")
        key = self._keys().find(token.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
        return key
