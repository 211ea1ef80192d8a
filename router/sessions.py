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
import time
from collections import OrderedDict, deque
from collections.abc import Callable

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


class _Op:
    """One queued command: GETEX (`expected`/`new` None) or the assign script."""

    __slots__ = ("key", "expected", "new", "future")

    def __init__(self, key: str, expected: str | None, new: str | None,
                 future: asyncio.Future) -> None:  # fmt: skip
        self.key = key
        self.expected = expected
        self.new = new
        self.future = future

    @property
    def command(self) -> str:
        return "get" if self.new is None else "assign"

    def settle(self, result: object) -> None:
        if not self.future.done():  # the caller may have been cancelled meanwhile
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)


class RedisSessionStore(SessionStore):
    """Mappings shared by every router replica through Redis (see module docstring).

    Commands are pipelined: every `get`/`assign` joins a FIFO queue, and up to
    `max_connections` pumps each send what is queued (at most `max_batch`
    commands) as one pipeline, one round trip. One caller alone pays one
    round trip as before; a burst of 200 new sessions (400 commands) costs a
    few pipelines instead of 400 commands through redis-py one by one, which
    on a 2-core machine took 32 ms (docs/benchmarks.md, Router). Commands
    in different pipelines may run in either order, as commands on different
    connections did before; one caller's `get` then `assign` stay in order.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        ttl_s: float = 3600.0,
        timeout_s: float = 0.5,
        max_connections: int = 8,
        max_batch: int = 256,
    ) -> None:
        import redis
        import redis.asyncio as aioredis

        if ttl_s <= 0:
            raise ValueError(f"session ttl_s must be > 0; got {ttl_s}")
        if timeout_s <= 0:
            raise ValueError(f"session store timeout_s must be > 0; got {timeout_s}")
        if max_connections <= 0:
            raise ValueError(f"session store max_connections must be > 0; got {max_connections}")
        if max_batch <= 0:
            raise ValueError(f"session store max_batch must be > 0; got {max_batch}")
        self._ttl_ms = int(ttl_s * 1000)
        self._max_pumps = max_connections
        self._max_batch = max_batch
        self._queue: deque[_Op] = deque()
        self._pumps = 0
        self._redis = aioredis.Redis.from_url(
            redis_url, decode_responses=True, max_connections=max_connections,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        )
        self._errors = (redis.RedisError, OSError, TimeoutError)
        self._no_script = redis.exceptions.NoScriptError
        self._assign_sha = self._redis.register_script(_ASSIGN_LUA).sha

    @staticmethod
    def key(role: str, session_id: str) -> str:
        return f"{SESSION_KEY_PREFIX}{role}:{session_id}"

    async def get(self, role: str, session_id: str) -> str | None:
        check_role(role)
        _check_session_id(session_id)
        return await self._submit(self.key(role, session_id), None, None)

    async def assign(self, role: str, session_id: str, expected: str | None, new: str) -> str:
        check_role(role)
        _check_session_id(session_id)
        return await self._submit(self.key(role, session_id), expected or "", new)

    async def _submit(self, key: str, expected: str | None, new: str | None):
        op = _Op(key, expected, new, asyncio.get_running_loop().create_future())
        self._queue.append(op)
        if self._pumps < self._max_pumps:
            self._pumps += 1
            asyncio.get_running_loop().create_task(self._pump())
        return await op.future

    async def _pump(self) -> None:
        """Send queued commands, a pipeline at a time, until the queue is empty.
        A new task first runs in the loop's next iteration, so the commands
        issued in this one have all joined the queue by then."""
        try:
            while self._queue:
                n = min(len(self._queue), self._max_batch)
                batch = [self._queue.popleft() for _ in range(n)]
                await self._execute(batch, retry_scripts=True)
        finally:
            self._pumps -= 1

    async def _execute(self, batch: list[_Op], retry_scripts: bool) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for op in batch:
            if op.new is None:
                pipe.getex(op.key, px=self._ttl_ms)
            else:
                pipe.evalsha(self._assign_sha, 1, op.key, op.expected, op.new, self._ttl_ms)
        try:
            results = await pipe.execute(raise_on_error=False)
        except self._errors as exc:
            for op in batch:
                op.settle(SessionStoreError(f"session store {op.command} failed: {exc!r}"))
            return
        unscripted = []
        for op, result in zip(batch, results, strict=True):
            if isinstance(result, self._no_script) and retry_scripts:
                unscripted.append(op)  # first use, or the server lost its script cache
            elif isinstance(result, Exception):
                op.settle(SessionStoreError(f"session store {op.command} failed: {result!r}"))
            else:
                op.settle(result)
        if unscripted:
            try:
                await self._redis.script_load(_ASSIGN_LUA)
            except self._errors:
                pass  # the retry reports the failure
            await self._execute(unscripted, retry_scripts=False)

    async def close(self) -> None:
        while self._queue:
            self._queue.popleft().settle(SessionStoreError("session store closed"))
        await self._redis.aclose(close_connection_pool=True)
