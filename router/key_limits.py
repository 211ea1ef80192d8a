"""Per-key token rates and who a request is, for the flow to charge.

`TokenRates` keeps one token bucket per API key that has a
`tokens_per_minute` (router/api_keys.py): capacity N, refilled at N/60 a
second. `admit` refuses (429, `Retry-After` = seconds until the bucket is
out of debt) a key whose bucket is in debt; a request admitted is charged
its prompt and output tokens when it ends (`charge`), so the limit bounds
the long-run rate while one request may overdraw it. One instance per
router process, used on its event loop only (no lock); with several router
workers each holds its own buckets, so a key's rate is per worker.

`CURRENT_CLIENT` carries the request's `Client` from the front door (the
HTTP middleware, the gRPC servicer) to `RequestFlow.run`, which charges the
tokens when the request ends, and to the log lines that name the key.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.api_error import ApiError
from router.api_keys import ApiKey


@dataclass(frozen=True, slots=True)
class Client:
    """Who sent a request: its key (None when the router checks none) and
    where tokens are charged (None: nowhere)."""

    key: ApiKey | None
    charge: Callable[[int], None] | None = None

    @property
    def name(self) -> str:
        return self.key.name if self.key is not None else ""


CURRENT_CLIENT: contextvars.ContextVar[Client | None] = contextvars.ContextVar(
    "pdserve_client", default=None)


def charge_current(num_tokens: int) -> None:
    """Charge the current request's key `num_tokens` (no-op without one)."""
    client = CURRENT_CLIENT.get()
    if client is not None and client.charge is not None and num_tokens > 0:
        client.charge(num_tokens)


class _Bucket:
    __slots__ = ("capacity", "rate", "tokens", "stamp")

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.tokens = self.capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now


class TokenRates:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, key: ApiKey) -> _Bucket | None:
        if key.tokens_per_minute is None:
            self._buckets.pop(key.name, None)
            return None
        bucket = self._buckets.get(key.name)
        now = self._clock()
        if bucket is None or bucket.capacity != key.tokens_per_minute:  # new, or reloaded
            bucket = self._buckets[key.name] = _Bucket(key.tokens_per_minute, now)
        bucket.refill(now)
        return bucket

    def admit(self, key: ApiKey) -> Callable[[int], None] | None:
        """The charge function of a request of `key`; ApiError 429 while its
        bucket is in debt. None for a key without a token rate."""
        bucket = self._bucket(key)
        if bucket is None:
            return None
        if bucket.tokens < 0:
            wait = math.ceil(-bucket.tokens / bucket.rate)
            raise ApiError(
                429, f"API key {key.name!r} is over its token rate: the limit is "
                     f"{key.tokens_per_minute} tokens per minute (prompt and output), and "
                     f"{-bucket.tokens:.0f} more tokens were used than it allows so far; "
                     f"retry in {wait} s",
                error_type="rate_limit_error", code="token_rate_exceeded", retry_after=wait)

        def charge(num_tokens: int) -> None:
            current = self._bucket(key)
            if current is not None:
                current.tokens -= num_tokens
        return charge

    def available(self, key: ApiKey) -> float | None:
        """Tokens left in `key`'s bucket now (negative: debt); None without a rate."""
        bucket = self._bucket(key)
        return None if bucket is None else bucket.tokens
