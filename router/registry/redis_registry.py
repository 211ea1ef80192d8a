"""Redis pod registry: pods found through the keys their `PodHeartbeat` refreshes.

Schema (proto/registry.py, written by pod/heartbeat.py, documented in docs/routing.md):
`pdserve:pods:{role}:{address}` -> JSON record, with a TTL. A pod that stops
refreshing (crash, network cut) disappears when its key expires; a clean
shutdown deletes the key at once. Either way the poller drops the pod at its
next `discover()`. Malformed records are logged and skipped, never fatal.
"""

from __future__ import annotations

import logging

from proto.registry import POD_KEY_PREFIX, parse_pod_record
from router.registry.base import PodEntry, PodSource

log = logging.getLogger(__name__)


class RedisPodSource(PodSource):
    """Discovers pods by SCANning `pdserve:pods:*`; awaited on the router's event loop."""

    def __init__(self, redis_url: str) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._bad_keys: set[str] = set()  # warn once per malformed key, not every poll

    async def discover(self) -> list[PodEntry]:
        keys = [key async for key in self._redis.scan_iter(match=POD_KEY_PREFIX + "*", count=500)]
        if not keys:
            return []
        values = await self._redis.mget(keys)
        entries: dict[str, PodEntry] = {}
        for key, value in zip(keys, values, strict=True):
            if value is None:  # expired between SCAN and MGET
                continue
            try:
                record = parse_pod_record(value)
                entry = PodEntry(address=record.address, role=record.role)
            except ValueError as exc:
                name = key.decode() if isinstance(key, bytes) else str(key)
                if name not in self._bad_keys:
                    self._bad_keys.add(name)
                    log.warning("ignoring pod registry key %s: %s", name, exc)
                continue
            entries[entry.address] = entry
        return sorted(entries.values(), key=lambda e: (e.role, e.address))

    async def close(self) -> None:
        await self._redis.aclose()
