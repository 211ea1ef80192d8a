"""One request's timeline, kept by the router without a tracing backend.

`RequestFlow` (router/flow/request_flow.py) owns a `Timeline` and stamps it
at phase boundaries only (its state changes, the admission wait, the pods
each attempt chose, what the pods' replies said: first token, KV bytes,
cached tokens); never per token. When the request ends the flow puts it in
the router's `History`, a ring of the last N finished requests keyed by
request id, which `GET /debug/requests/{id}` (router/http/server.py) and
`pdserve trace ID` read. The same stamps make the router's spans when
tracing is on (router/flow/tracing.py).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

RESPONSE_PREFIXES = ("chatcmpl-", "cmpl-")
MAX_HISTORY = 1_000_000


class Timeline:
    """Phase stamps of one request (monotonic seconds). `phases` holds
    (name, start, end, details); a phase's end is None while it runs.
    `events`: (name, at, details): retries, migrations, the first token."""

    __slots__ = ("request_id", "key_name", "started", "wall_started", "phases", "events",
                 "attempts", "attributes", "outcome", "ended", "trace_id", "_running")

    def __init__(self, request_id: str, key_name: str | None = None) -> None:
        self.request_id = request_id
        self.key_name = key_name
        self.started = time.monotonic()
        self.wall_started = time.time()
        self.phases: list[list[Any]] = []
        self.events: list[tuple[str, float, dict[str, Any]]] = []
        self.attempts: list[dict[str, Any]] = []
        self.attributes: dict[str, Any] = {}
        self.outcome: str | None = None
        self.ended: float | None = None
        self.trace_id: str | None = None
        self._running: list[Any] | None = None  # the phase `enter` began, until the next

    def enter(self, name: str, details: dict[str, Any] | None = None,
              at: float | None = None) -> None:
        """Phase `name` starts now (`at`); the running one, if any, ends."""
        at = time.monotonic() if at is None else at
        self.close_phase(at)
        self._running = [name, at, None, details or {}]
        self.phases.append(self._running)

    def close_phase(self, at: float | None = None) -> None:
        if self._running is not None:
            self._running[2] = time.monotonic() if at is None else at
            self._running = None

    def phase(self, name: str, start: float, end: float, details: dict[str, Any] | None = None
              ) -> None:
        """A phase timed by its caller (admission wait), kept in start order."""
        self.phases.append([name, start, end, details or {}])

    def event(self, name: str, details: dict[str, Any] | None = None) -> None:
        self.events.append((name, time.monotonic(), details or {}))

    def finish(self, outcome: str) -> None:
        self.ended = time.monotonic()
        self.close_phase(self.ended)
        self.outcome = outcome

    def to_json(self) -> dict[str, Any]:
        """The timeline as `GET /debug/requests/{id}` shows it (ms from the start)."""
        def ms(at: float) -> float:
            return round((at - self.started) * 1000.0, 3)
        ended = self.ended if self.ended is not None else time.monotonic()
        phases = sorted(self.phases, key=lambda p: p[1])
        return {
            "id": self.request_id,
            "outcome": self.outcome,
            "started_at": self.wall_started,
            "duration_ms": ms(ended),
            "trace_id": self.trace_id,
            **self.attributes,
            "attempts": self.attempts,
            "phases": [{"phase": name, "start_ms": ms(start),
                        "duration_ms": round(((end if end is not None else ended) - start)
                                             * 1000.0, 3), "details": details}
                       for name, start, end, details in phases],
            "events": [{"event": name, "at_ms": ms(at), "details": details}
                       for name, at, details in self.events],
        }


class History:
    """The last `size` finished requests' timelines (0 = keep none), by
    request id. Written on the router's event loop, read by its handlers;
    the lock keeps it safe from any other thread too."""

    def __init__(self, size: int = 1000) -> None:
        if not 0 <= size <= MAX_HISTORY:
            raise ValueError(f"--trace-history must be in [0, {MAX_HISTORY}], got {size}")
        self.size = size
        self._items: collections.OrderedDict[str, Timeline] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, timeline: Timeline) -> None:
        if not self.size:
            return
        with self._lock:
            self._items[timeline.request_id] = timeline
            self._items.move_to_end(timeline.request_id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def find(self, request_id: str) -> Timeline | None:
        """The timeline of `request_id` (or the response's id: chatcmpl-<id>,
        cmpl-<id>); None when unknown or no longer kept."""
        for prefix in RESPONSE_PREFIXES:
            if request_id.startswith(prefix):
                request_id = request_id[len(prefix):]
                break
        with self._lock:
            return self._items.get(request_id)

    def __len__(self) -> int:
        return len(self._items)
