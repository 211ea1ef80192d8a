"""Session -> pod mappings, so every request of a session goes to the same pod.

`RoutingPolicy` asks the store which pod a session is on (`get`) and records a
new or changed mapping (`assign`). Two implementations:

* `InMemorySessionStore` (default): an LRU dict with a TTL, private to one
  router process.
* `RedisSessionStore` (`--redis-url`): keys `pdserve:session:{role}:{session_id}`
  holding the pod address, with a TTL refreshed on every use. `assign` is one
  atomic Lua compare-and-set, so when two router replicas place a new session
  at the same moment exactly one mapping wins and both route to it.

`assign(role, session_id, expected, new)` is a compare-and-set: it stores
`new` only if the current mapping is `expected` (None = no mapping) and returns
the mapping that holds afterwards — `new` if it won, otherwise the mapping some
other router wrote first. The policy then uses the returned pod.

Both are called only from the router's event loop (async methods; the
in-memory one never actually awaits).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from router.routing.base import check_role

SESSION_KEY_PREFIX = "pdserve:session:"


class SessionStoreError(Exception):
    """The store could not be reached (e.g. Redis down or slow). The policy then
    routes by rendezvous ranking alone — the same pod while the pod set and
    loads are unchanged — and logs it; requests keep being served."""


def _check_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > 256:
        raise ValueError(f"session id must be 1..256 characters; got {len(session_id)}")


class SessionStore(abc.ABC):
    """Where session -> pod mappings live. See the module docstring for the semantics."""

    @abc.abstractmethod
    async def get(self, role: str, session_id: str) -> str | None:
        """The pod `session_id` is mapped to for `role`, refreshing its TTL; None if unmapped."""

    @abc.abstractmethod
    async def assign(self, role: str, session_id: str, expected: str | None, new: str) -> str:
        """Map the session to `new` if it is currently mapped to `expected`; return the winner."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Awaited once by the router at shutdown."""


class InMemorySessionStore(SessionStore):
    """LRU + TTL mapping in this process: at most `max_sessions`, each forgotten after
    `ttl_s` seconds without a request."""

    def __init__(
        self,
        *,
        ttl_s: float = 3600.0,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session ttl_s must be > 0; got {ttl_s}")
        if max_sessions <= 0:
            raise ValueError(f"max_sessions must be > 0; got {max_sessions}")
        self._ttl_s = ttl_s
        self._max_sessions = max_sessions
        self._clock = clock
        # (role, session_id) -> (address, expires_at); order = least recently used first
        self._entries: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, role: str, session_id: str) -> str | None:
        check_role(role)
        _check_session_id(session_id)
        return self._lookup((role, session_id))

    async def assign(self, role: str, session_id: str, expected: str | None, new: str) -> str:
        check_role(role)
        _check_session_id(session_id)
        key = (role, session_id)
        current = self._lookup(key)
        if current != expected:
            return current if current is not None else self._store(key, new)
        return self._store(key, new)

    async def close(self) -> None:
        self._entries.clear()

    def _lookup(self, key: tuple[str, str]) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        address, expires_at = entry
        now = self._clock()
        if expires_at <= now:
            del self._entries[key]
            return None
        self._entries[key] = (address, now + self._ttl_s)
        self._entries.move_to_end(key)
        return address

    def _store(self, key: tuple[str, str], address: str) -> str:
        self._entries[key] = (address, self._clock() + self._ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_sessions:
            self._entries.popitem(last=False)  # evict the least recently used session
        return address


# KEYS[1] = session key; ARGV = expected ("" = none), new, ttl in ms.
# Returns the mapping that holds after the call. Atomic on the Redis server.
_ASSIGN_LUA = """
local current = redis.call('GET', KEYS[1])
if current == false then current = '' end
if current == ARGV[1] or current == '' then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return ARGV[2]
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return current
"""


class RedisSessionStore(SessionStore):
    """Mappings shared by every router replica through Redis (see module docstring)."""

    def __init__(
        self,
        redis_url: str,
        *,
        ttl_s: float = 3600.0,
        timeout_s: float = 0.5,
        max_connections: int = 8,
    ) -> None:
        import redis
        import redis.asyncio as aioredis

        if ttl_s <= 0:
            raise ValueError(f"session ttl_s must be > 0; got {ttl_s}")
        if timeout_s <= 0:
            raise ValueError(f"session store timeout_s must be > 0; got {timeout_s}")
        if max_connections <= 0:
            raise ValueError(f"session store max_connections must be > 0; got {max_connections}")
        self._ttl_ms = int(ttl_s * 1000)
        # At most `max_connections` commands in flight, the rest wait their turn in
        # FIFO order on the semaphore: the default pool refuses outright
        # (MaxConnectionsError) when a burst exceeds it, and redis-py's blocking
        # pool wakes waiters unfairly (some wait ~0.4 s under a 200-request burst).
        self._slots = asyncio.Semaphore(max_connections)
        self._redis = aioredis.Redis.from_url(
            redis_url, decode_responses=True, max_connections=max_connections,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        )
        self._errors = (redis.RedisError, OSError, TimeoutError)
        self._assign = self._redis.register_script(_ASSIGN_LUA)

    @staticmethod
    def key(role: str, session_id: str) -> str:
        return f"{SESSION_KEY_PREFIX}{role}:{session_id}"

    async def get(self, role: str, session_id: str) -> str | None:
        check_role(role)
        _check_session_id(session_id)
        try:
            async with self._slot():
                return await self._redis.getex(self.key(role, session_id), px=self._ttl_ms)
        except self._errors as exc:
            raise SessionStoreError(f"session store get failed: {exc!r}") from exc

    async def assign(self, role: str, session_id: str, expected: str | None, new: str) -> str:
        check_role(role)
        _check_session_id(session_id)
        try:
            async with self._slot():
                return await self._assign(
                    keys=[self.key(role, session_id)], args=[expected or "", new, self._ttl_ms]
                )
        except self._errors as exc:
            raise SessionStoreError(f"session store assign failed: {exc!r}") from exc

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """Wait (FIFO) for one of the `max_connections` command slots. The wait is
        bounded because every command holding a slot is bounded by timeout_s."""
        await self._slots.acquire()
        try:
            yield
        finally:
            self._slots.release()

    async def close(self) -> None:
        await self._redis.aclose(close_connection_pool=True)
