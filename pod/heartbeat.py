"""`PodHeartbeat`: pod registration in Redis, the pod side of the router's
Redis registry. The key schema and record format are in proto/registry.py
(keys expire after `ttl_s`, default 6 s).

A pod started with `--redis-url` creates a `PodHeartbeat` once it serves and
calls `.start()`: a daemon thread rewrites the key every `ttl_s / 3` seconds,
so the key outlives one or two missed beats but disappears within `ttl_s` of a
crash. `.stop()` (on drain / shutdown, from the pod's main thread) stops the
thread and deletes the key, so routers drop the pod at their next poll instead
of after the TTL. The router side (router/registry/redis_registry.py) SCANs
`pdserve:pods:*` and parses values with `proto.registry.parse_pod_record`.

Plain Python + the sync redis client: no torch, no asyncio, so any pod
command can use it whatever its threading.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from proto.registry import PodRecord

log = logging.getLogger(__name__)


class PodHeartbeat:
    """Keeps this pod's registry key alive while the pod serves (see module docstring).

    `start()` and `stop()` are called from the pod's main thread; the refresh
    runs on a private daemon thread. A Redis outage is logged and retried at
    the next beat — the pod keeps serving, it just drops out of Redis-based
    discovery until Redis is back.
    """

    def __init__(
        self, redis_url: str, *, role: str, address: str, model: str, ttl_s: float = 6.0
    ) -> None:
        if not 0.5 <= ttl_s <= 3600:
            raise ValueError(f"heartbeat ttl_s must be in [0.5, 3600] seconds; got {ttl_s}")
        self.record = PodRecord(address=address, role=role, model=model, started_at=time.time())
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=max(0.2, ttl_s / 3))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return self.record.key

    def beat(self) -> bool:
        """Write the key once with its TTL (the thread calls this every ttl_s / 3).
        Returns whether the key was still there (False: it had vanished, or first beat)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.exists(self.key)
        pipe.set(self.key, self.record.to_json(), px=int(self.ttl_s * 1000))
        existed, _ = pipe.execute()
        return bool(existed)

    def start(self) -> None:
        """Register now (raising if Redis is unreachable, so a typo in --redis-url fails
        the pod's startup loudly), then keep refreshing in the background."""
        if self._thread is not None:
            raise RuntimeError("PodHeartbeat.start() called twice")
        self.beat()
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-{self.record.role}", daemon=True
        )
        self._thread.start()
        log.info("registered %s pod %s in Redis as %s (ttl %.1fs)",
                 self.record.role, self.record.address, self.key, self.ttl_s)

    def stop(self) -> None:
        """Stop refreshing and delete the key. Idempotent; never raises on Redis errors."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)
        try:
            self._redis.delete(self.key)
        except redis.RedisError as exc:
            log.warning("could not delete %s (it expires in %.1fs): %s", self.key, self.ttl_s, exc)
        self._redis.close()

    def _run(self) -> None:
        interval = self.ttl_s / 3
        while not self._stop.wait(interval):
            try:
                if not self.beat():
                    log.warning("registry key %s had vanished (Redis restarted or flushed?); "
                                "registered again", self.key)
            except redis.RedisError as exc:
                log.warning("heartbeat to Redis failed for %s: %s", self.key, exc)
