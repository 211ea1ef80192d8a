"""`ClientConcurrency`: at most N generation requests in flight per client,
so one client cannot take every slot of the router (both front doors share
one count, `--max-concurrent-per-client`, 0 = off; gRPC answers
RESOURCE_EXHAUSTED, router/grpc_server.py).

A client is its API key's name when the router checks keys, else its
address as the connection shows it (behind a proxy or load balancer that
does not preserve addresses, every client shares the proxy's address: set
the limit with that in mind). A key with its own `max_concurrent`
(router/api_keys.py) is held to that instead of the router-wide limit. A request over
the limit is answered 429 at once, its body unread, with a message naming the
limit; a slot is held from the handler's start until its response (a stream:
its last event) is sent or the client goes away.

One instance per router process, used by the HTTP middleware and the gRPC
servicer on the router's event loop only (no lock needed). With several
router workers the limit holds per worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from router.api_error import ApiError


class ClientConcurrency:
    """Counts in-flight requests per client key; `limit` 0 turns it off."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 (0 = off), got {limit}")
        self.limit = limit
        self._in_flight: dict[str, int] = {}

    @staticmethod
    def client_key(key_name: str | None, address: str | None) -> str:
        """The key a request counts under: its API key's name, else its address."""
        if key_name:
            return "key:" + key_name
        return "addr:" + (address or "unknown")

    def in_flight(self, key: str) -> int:
        return self._in_flight.get(key, 0)

    @contextlib.contextmanager
    def hold(self, key: str, kind: str, own_limit: int | None = None) -> Iterator[None]:
        """One slot of `key` for the `with` block; ApiError 429 when all are
        taken. `kind` ("API key" / "client address") words the message;
        `own_limit`: the key's own max_concurrent, instead of `limit`."""
        limit = self.limit if own_limit is None else own_limit
        if limit == 0:
            yield
            return
        count = self._in_flight.get(key, 0)
        if count >= limit:
            source = (f"per {kind} (--max-concurrent-per-client)" if own_limit is None
                      else f"(max_concurrent of API key {key.removeprefix('key:')!r})")
            raise ApiError(
                429, f"too many concurrent requests from this {kind}: {count} in flight, "
                     f"the limit is {limit} {source}; retry when one has finished",
                error_type="rate_limit_error", code="concurrency_limit_exceeded",
                retry_after=1)
        self._in_flight[key] = count + 1
        try:
            yield
        finally:
            left = self._in_flight[key] - 1
            if left:
                self._in_flight[key] = left
            else:
                del self._in_flight[key]
