"""The Redis pod registry's record: key schema and value format, shared by the
pods that write it (pod/heartbeat.py) and the routers that read it
(router/registry/redis_registry.py). It is a wire contract like the .proto,
so it lives here, in plain Python with no project imports.

Key schema (also in docs/routing.md):

    pdserve:pods:{role}:{address}  ->  JSON {"address", "role", "model", "started_at"}
                                       with a TTL the pod keeps refreshing

Pub/sub channel (pod/cache_events.py publishes, router/cache_index/feed.py
subscribes):

    pdserve:cache-events  <-  serialized pdserve.v1.CacheEventBatch messages
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from proto.address import split_host_port
from proto.roles import PodRole

POD_KEY_PREFIX = "pdserve:pods:"
CACHE_EVENTS_CHANNEL = "pdserve:cache-events"


@dataclass(frozen=True, slots=True)
class PodRecord:
    """What a pod publishes about itself. `address` is host:port of its gRPC server."""

    address: str
    role: str  # a PodRole value
    model: str
    started_at: float  # unix seconds

    def __post_init__(self) -> None:
        PodRole.parse(self.role, "pod role")
        split_host_port(self.address, "pod address")

    @property
    def key(self) -> str:
        return pod_key(self.role, self.address)

    def to_json(self) -> str:
        return json.dumps(
            {"address": self.address, "role": self.role, "model": self.model,
             "started_at": self.started_at},
            sort_keys=True,
        )


def pod_key(role: str, address: str) -> str:
    """The Redis key a pod of `role` at `address` refreshes."""
    return f"{POD_KEY_PREFIX}{role}:{address}"


def parse_pod_record(value: str | bytes) -> PodRecord:
    """Parse a key's JSON value; ValueError naming the problem if it is malformed."""
    try:
        data = json.loads(value)
        return PodRecord(
            address=str(data["address"]),
            role=str(data["role"]),
            model=str(data.get("model", "")),
            started_at=float(data.get("started_at", 0.0)),
        )
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed pod record {value!r}: {exc}") from exc
