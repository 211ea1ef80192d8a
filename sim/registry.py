"""`SharedHeartbeat`: the Redis registration of every simulated pod of a
process, in one pipeline per beat.

Who uses it: each simulated pod's `PodServer` (sim/pods.py) adds its
record when it starts serving and removes it when it drains, where a real
pod starts and stops its own `pod.heartbeat.PodHeartbeat` (one thread and
one Redis connection per pod: a thousand of each for a thousand simulated
pods). The keys, records and TTL are the real ones (`PodRecord`,
proto/registry.py; `PodHeartbeat.ttl_s`), so a router's Redis registry
cannot tell the two apart: a key is written with its TTL every `ttl_s / 3`
seconds and deleted when its pod drains (the router then drops the pod at
its next poll), and a killed process's keys expire within `ttl_s`.

`beat()` and `remove()` are synchronous Redis calls made from the event
loop: one pipelined round trip per beat for all pods, a few milliseconds
for a thousand keys on loopback, which the simulated pods can afford.
"""

from __future__ import annotations

import asyncio
import logging

import redis

from proto.registry import PodRecord

log = logging.getLogger(__name__)


class SharedHeartbeat:
    """Every registered pod's key rewritten with its TTL every `ttl_s / 3`."""

    def __init__(self, redis_url: str, ttl_s: float = 6.0) -> None:
        if not 0.5 <= ttl_s <= 3600:
            raise ValueError(f"heartbeat ttl_s must be in [0.5, 3600] seconds; got {ttl_s}")
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=max(0.2, ttl_s / 3))
        self._records: dict[str, PodRecord] = {}
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: PodRecord) -> None:
        """Register now (raising when Redis is unreachable, as a real pod's
        start does), and keep the key alive from the next beat on."""
        self._redis.set(record.key, record.to_json(), px=int(self.ttl_s * 1000))
        self._records[record.key] = record
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="heartbeat")

    def remove(self, record: PodRecord) -> None:
        """The pod drains: its key goes now, so routers drop it at their next poll."""
        self._records.pop(record.key, None)
        try:
            self._redis.delete(record.key)
        except redis.RedisError as exc:
            log.warning("could not delete %s (it expires in %.1fs): %s", record.key, self.ttl_s,
                        exc)

    def forget(self, record: PodRecord) -> None:
        """Stop refreshing the key (a killed pod): it expires within `ttl_s`."""
        self._records.pop(record.key, None)

    def beat(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key, record in self._records.items():
            pipe.set(key, record.to_json(), px=int(self.ttl_s * 1000))
        pipe.execute()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat of %d simulated pods failed: %s", len(self._records), exc)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._redis.close()
