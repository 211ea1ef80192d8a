"""`CacheEventHub`: a pod tells the routers which prefix blocks it caches.

The engine's `PrefixCache` calls `stored(hash)` / `evicted(hash)` on the
engine loop thread for every block hash entering or leaving the cache
(the chained xxhash64 of proto/block_hash.py, under this pod's block size).
The hub coalesces them (a hash's last change wins) into `CacheEventBatch`
messages, numbered 1, 2, ... per pod generation, and delivers each batch

* to every `CacheEvents.Subscribe` stream (a router without Redis subscribes
  to each pod directly; the stream opens with a snapshot of every cached
  hash, so a router that (re)connects starts from the truth), and
* with `--redis-url`, to the Redis pub/sub channel `CACHE_EVENTS_CHANNEL`
  (router replicas with Redis subscribe there: one publish per batch
  whatever the number of routers; `LoadReport.cache_events_channel` names it).

Why pub/sub and not a stream: a router's index is a hint. A batch a router
misses (Redis down, subscriber reconnecting, a router started later) can only
make it believe a pod holds blocks it evicted, or not know blocks it stored:
a cache miss, never a wrong answer, since the pod computes whatever its own
cache lacks. Pub/sub keeps nothing in Redis and needs no trimming or
consumer bookkeeping; a Redis stream would replay history nobody needs.

Threads: `stored` / `evicted` run on the engine loop thread and only record
under a lock; the first change after a flush wakes the pod's event loop
(`call_soon_threadsafe`), which takes everything pending as one batch. A
subscriber registers on the engine loop thread (`EngineLoop.call`), so its
snapshot and the changes after it are never interleaved.

A subscriber that falls `MAX_QUEUED_BATCHES` behind is dropped (its stream
ends; the router reconnects and gets a fresh snapshot), so a stuck router
cannot grow the pod's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine.engine_loop import EngineLoop
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.registry import CACHE_EVENTS_CHANNEL

log = logging.getLogger(__name__)

MAX_QUEUED_BATCHES = 1024
_PUBLISH_WARNING_INTERVAL_S = 10.0


@dataclass(slots=True)
class _Subscriber:
    snapshot: pdserve_pb2.CacheEventBatch | None = None
    queue: asyncio.Queue[pdserve_pb2.CacheEventBatch | None] = field(
        default_factory=asyncio.Queue)


class CacheEventHub:
    """One pod's prefix-cache events (see the module docstring). Created by the
    pod's server module on its event loop; `attach` once the engine loop runs,
    `start` once the pod's address is known, `close` at shutdown."""

    def __init__(self, *, role: str, generation: int, block_size: int,
                 redis_url: str | None = None) -> None:
        self.role = role
        self.generation = generation
        self.block_size = block_size
        self.address = ""
        self._lock = threading.Lock()
        self._pending: dict[int, bool] = {}  # hash -> stored (True) / evicted (False)
        self._sequence = 0
        self._subscribers: list[_Subscriber] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._redis_url = redis_url
        self._publisher: _RedisPublisher | None = None

    @property
    def channel(self) -> str:
        """The Redis channel batches go to ("" without Redis): the pod's
        `LoadReport.cache_events_channel`."""
        return CACHE_EVENTS_CHANNEL if self._redis_url else ""

    # ------------------------------------------------------------ set-up (pod's event loop)

    async def attach(self, engine_loop: EngineLoop) -> None:
        """Become the engine's prefix-cache listener (on its loop thread)."""
        self._loop = asyncio.get_running_loop()
        await engine_loop.call(
            lambda engine: engine.block_manager.prefix_cache.set_listener(self))

    def start(self, address: str) -> None:
        """The pod serves at `address` (as it registers in Redis): batches name
        it from now on, and go to Redis too when the hub has a Redis URL."""
        self.address = address
        if self._redis_url and self._publisher is None:
            self._publisher = _RedisPublisher(self._redis_url)

    async def close(self) -> None:
        with self._lock:
            subscribers, self._subscribers = self._subscribers, []
        for subscriber in subscribers:
            subscriber.queue.put_nowait(None)
        if self._publisher is not None:
            await self._publisher.close()

    # ------------------------------------------------------------ engine loop thread

    def stored(self, block_hash: int) -> None:
        self._record(block_hash, True)

    def evicted(self, block_hash: int) -> None:
        self._record(block_hash, False)

    def _record(self, block_hash: int, stored: bool) -> None:
        with self._lock:
            wake = not self._pending
            self._pending[block_hash] = stored
        if wake and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the pod's loop closed: shutting down
                self._loop.call_soon_threadsafe(self._flush)

    def _register(self, engine: Any, subscriber: _Subscriber) -> None:
        """Engine loop thread: snapshot now, and every change after it queued."""
        cached = engine.block_manager.prefix_cache.cached_hashes()
        with self._lock:
            subscriber.snapshot = self._batch(self._sequence, cached, [], snapshot=True)
            self._subscribers.append(subscriber)

    # ------------------------------------------------------------ pod's event loop

    def _flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
            pending, self._pending = self._pending, {}
            self._sequence += 1
            batch = self._batch(self._sequence, [h for h, s in pending.items() if s],
                                [h for h, s in pending.items() if not s], snapshot=False)
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            if subscriber.queue.qsize() >= MAX_QUEUED_BATCHES:
                log.warning("dropping a cache-event subscriber %d batches behind; it will "
                            "reconnect and start from a snapshot", MAX_QUEUED_BATCHES)
                self._drop(subscriber)
                subscriber.queue.put_nowait(None)
            else:
                subscriber.queue.put_nowait(batch)
        if self._publisher is not None:
            self._publisher.publish(batch)

    def _batch(self, sequence: int, stored: list[int], evicted: list[int], *,
               snapshot: bool) -> pdserve_pb2.CacheEventBatch:
        return pdserve_pb2.CacheEventBatch(
            address=self.address, role=self.role, generation=self.generation,
            block_size=self.block_size, sequence=sequence, snapshot=snapshot,
            stored=stored, evicted=evicted)

    def _drop(self, subscriber: _Subscriber) -> None:
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

    async def subscribe(self, engine_loop: EngineLoop
                        ) -> AsyncIterator[pdserve_pb2.CacheEventBatch]:
        """The snapshot, then every batch, until the pod closes the hub (or the
        caller stops iterating)."""
        subscriber = _Subscriber()
        await engine_loop.call(lambda engine: self._register(engine, subscriber))
        try:
            assert subscriber.snapshot is not None
            yield subscriber.snapshot
            while (batch := await subscriber.queue.get()) is not None:
                yield batch
        finally:
            self._drop(subscriber)


class CacheEventsServicer(pdserve_pb2_grpc.CacheEventsServicer):
    """`CacheEvents.Subscribe` over the hub; not counted by the drain gate (a
    subscription is not work: the server's stop ends it)."""

    def __init__(self, hub: CacheEventHub, engine_loop: EngineLoop) -> None:
        self._hub = hub
        self._engine_loop = engine_loop

    async def Subscribe(self, request: pdserve_pb2.CacheEventsRequest,
                        context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pdserve_pb2.CacheEventBatch]:
        async for batch in self._hub.subscribe(self._engine_loop):
            yield batch


def add_cache_events(server: grpc.aio.Server, *, role: str, generation: int,
                     engine_loop: EngineLoop, redis_url: str | None) -> CacheEventHub:
    """A hub for this pod, its `CacheEvents` service added to `server` (the
    role's server module calls this before the server starts, then
    `await hub.attach(engine_loop)` once the engine loop runs)."""
    hub = CacheEventHub(role=role, generation=generation, block_size=engine_loop.block_size,
                        redis_url=redis_url)
    pdserve_pb2_grpc.add_CacheEventsServicer_to_server(CacheEventsServicer(hub, engine_loop),
                                                       server)
    return hub


class _RedisPublisher:
    """PUBLISHes batches in order from one task; a failed publish is logged
    (once per interval) and the batch dropped: routers then miss it, which
    costs at most a cache miss (module docstring)."""

    def __init__(self, redis_url: str) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=0.5)
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=MAX_QUEUED_BATCHES)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cache-events")
        self._warned_at = -_PUBLISH_WARNING_INTERVAL_S

    def publish(self, batch: pdserve_pb2.CacheEventBatch) -> None:
        try:
            self._queue.put_nowait(batch.SerializeToString())
        except asyncio.QueueFull:
            self._warn("Redis publishing is too far behind; dropping a batch")

    async def _run(self) -> None:
        while True:
            message = await self._queue.get()
            try:
                await self._redis.publish(CACHE_EVENTS_CHANNEL, message)
            except Exception as exc:  # noqa: BLE001 - Redis down: drop, keep serving
                self._warn(f"publishing cache events to Redis failed: {exc!r}")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _PUBLISH_WARNING_INTERVAL_S:
            self._warned_at = now
            log.warning("%s (routers miss these cache events: cache misses only)", message)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._redis.aclose()
