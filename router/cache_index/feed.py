"""`CacheEventFeed`: brings every pod's prefix-cache events into the router's
`PrefixIndex`.

Per pod, one of two ways (chosen from its `LoadReport.cache_events_channel`):

* **Redis** — the pod publishes to the pub/sub channel its report names and
  this router has `--redis-url`: one subscription (`CACHE_EVENTS_CHANNEL`)
  serves every such pod; batches carry the pod's address. Pub/sub keeps no
  history, so for each such pod (and each new generation of it) the router
  also takes one snapshot from its `Subscribe` stream and closes it: a router
  that starts after the pods (or restarts) knows what they hold at once.
* **direct** — otherwise: a `CacheEvents.Subscribe` server stream to the pod,
  which opens with a snapshot of everything the pod caches, so a router that
  (re)connects starts from the truth.

Life cycle, on the router's event loop: `start()` subscribes to Redis (when
configured) and runs `sync()` every `interval` seconds: it tells the index
each healthy pod's polled generation (a restart clears that pod's entries),
opens a direct stream for each healthy pod that needs one and has none, and
forgets pods that left the registry (their streams cancelled, their entries
dropped). A stream or the Redis subscription that fails is logged and
re-opened by a later sync; in between, events are missed, which costs cache
misses only (router/cache_index/index.py). `close()` cancels everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from prometheus_client import Gauge

from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.limits import GRPC_MESSAGE_OPTIONS
from proto.registry import CACHE_EVENTS_CHANNEL
from proto.tls import PodSecurity, pod_channel
from router.cache_index.index import PrefixIndex
from router.routing.base import ROLES, PodPool

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 5.0


class CacheEventFeed:
    """Keeps `index` fed from the pods of `pool`; see the module docstring."""

    def __init__(self, pool: PodPool, index: PrefixIndex, *, redis_url: str | None = None,
                 interval: float = 0.5, blocks_gauge: Gauge | None = None,
                 missed_gauge: Gauge | None = None,
                 security: PodSecurity | None = None) -> None:
        if not 0.01 <= interval <= 60:
            raise ValueError(f"cache event sync interval must be in [0.01, 60] s; got {interval}")
        self.pool = pool
        self.index = index
        self.interval = interval
        self._redis_url = redis_url
        self._security = security or PodSecurity()
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._known: set[str] = set()
        self._snapshotted: dict[str, int] = {}  # Redis-fed pod -> generation snapshotted
        self._gauged: set[str] = set()  # pod labels of blocks_gauge
        self._blocks_gauge = blocks_gauge
        self._missed_gauge = missed_gauge

    async def start(self) -> None:
        self.sync()
        if self._redis_url:
            self._tasks.append(asyncio.create_task(self._redis_loop(), name="cache-events-redis"))
        self._tasks.append(asyncio.create_task(self._sync_loop(), name="cache-events-sync"))

    async def close(self) -> None:
        tasks = [*self._tasks, *self._streams.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_TIMEOUT_S)
        self._tasks.clear()
        self._streams.clear()

    def streams(self) -> list[str]:
        """Addresses with a direct stream open (for tests and /metrics)."""
        return sorted(a for a, t in self._streams.items() if not t.done())

    def sync(self) -> None:
        """Match the subscriptions to the pool now (see the module docstring)."""
        self._known = {a for role in ROLES for a in self.pool.known(role)}
        for address in [a for a in self._streams if a not in self._known]:
            self._streams.pop(address).cancel()
            self._snapshotted.pop(address, None)
        for address in set(self.index.addresses()) | set(self._gauged):
            if address not in self._known:
                self.index.forget(address)
                if self._blocks_gauge is not None and address in self._gauged:
                    self._blocks_gauge.remove(address)
        self._gauged = set(self._known)
        for role in ROLES:
            for pod in self.pool.pods(role):
                self.index.observe_generation(pod.address, pod.generation)
                # a Redis-fed pod: one snapshot per generation, then its batches
                # come through the Redis subscription
                once = bool(pod.cache_events_channel and self._redis_url)
                if once and self._snapshotted.get(pod.address) == pod.generation:
                    continue
                task = self._streams.get(pod.address)
                if task is None or task.done():
                    self._streams[pod.address] = asyncio.create_task(
                        self._stream(pod.address, once=once),
                        name=f"cache-events-{pod.address}")
        if self._blocks_gauge is not None:
            for address in self._known:
                self._blocks_gauge.labels(pod=address).set(self.index.num_blocks(address))
        if self._missed_gauge is not None:
            self._missed_gauge.set(self.index.missed_batches)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.sync()
            except Exception:  # never let one bad sync stop the feed
                log.exception("cache event sync failed")

    async def _stream(self, address: str, *, once: bool = False) -> None:
        """One pod's direct subscription, until it ends or fails (`once`: its
        snapshot only)."""
        channel = pod_channel(address, self._security, GRPC_MESSAGE_OPTIONS)
        try:
            stub = pdserve_pb2_grpc.CacheEventsStub(channel)
            async for batch in stub.Subscribe(pdserve_pb2.CacheEventsRequest()):
                self.index.apply(batch, address)
                if once:
                    self._snapshotted[address] = batch.generation
                    break
        except grpc.aio.AioRpcError as exc:
            log.info("cache events from %s stopped (%s %s); resubscribing at a later sync",
                     address, exc.code().name, exc.details())
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), _CLOSE_TIMEOUT_S)

    async def _redis_loop(self) -> None:
        import redis.asyncio as aioredis

        assert self._redis_url is not None
        while True:
            client = aioredis.Redis.from_url(self._redis_url, socket_timeout=None,
                                             socket_connect_timeout=2.0)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(CACHE_EVENTS_CHANNEL)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._apply_published(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down: retry, routing goes on
                log.warning("cache events from Redis stopped (%r); resubscribing in %.1fs",
                            exc, self.interval)
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(self.interval)

    def _apply_published(self, data: bytes) -> None:
        try:
            batch = pdserve_pb2.CacheEventBatch.FromString(data)
        except Exception:  # noqa: BLE001 - not ours: skip
            log.warning("ignoring a malformed message on %s", CACHE_EVENTS_CHANNEL)
            return
        if batch.address in self._known:  # pods the pool knows only: bounded memory
            self.index.apply(batch)
