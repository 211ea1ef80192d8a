"""A pod as the router's pool (router/registry/poller.py) keeps it: its
state machine (`PodState`, checked transitions) and its bookkeeping (`PodRecord`:
last report, failures, registry absence, load stream). The pool's module
docstring draws the life of a pod; this module holds the pieces it moves.
Everything here is touched only on the router's event loop."""

from __future__ import annotations

import enum
import heapq
import logging
from dataclasses import dataclass

import grpc

from proto import pdserve_pb2
from router.registry.base import PodEntry
from router.registry.load_watch import LoadWatch
from router.routing.base import PodLoad

log = logging.getLogger("router.registry.poller")  # one logger for the pool's lines

# Slow answers (the poll's deadline passed) a HEALTHY pod is allowed in a row
# before it stops getting traffic. A pod whose event loop is starved for a
# moment (a CPU-saturated node, a long GC) is alive, and taking it out turns
# every request that would have queued there into a 503; a dead pod refuses
# the connection (UNAVAILABLE) and leaves at its first failed poll, and a
# request sent to a pod that then dies is retried or moved by the request path.
SLOW_POLLS_TOLERATED = 2

# Polls one round sends at most, the pods polled longest ago (never: 0) first;
# the rest wait for the next round. A router meeting 1,000 new pods at once
# (its start, a registry listing after an outage) otherwise polls them all
# every round, and pods too busy to answer in time are polled again, all
# of them, before any stream opens: two routers starting beside a saturated
# simulator of 1,000 pods did not see them all in 10 minutes
# (docs/simulator.md). 256 a round opens every stream within 4 rounds.
MAX_POLLS_PER_ROUND = 256


def longest_unpolled(due: list[PodRecord], limit: int) -> list[PodRecord]:
    """At most `limit` of `due`, those polled longest ago first
    (`MAX_POLLS_PER_ROUND`)."""
    if len(due) <= limit:
        return due
    return heapq.nsmallest(limit, due, key=lambda pod: pod.polled_at)


class PodState(enum.Enum):
    NEW = "new"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


_TRANSITIONS: dict[PodState, frozenset[PodState]] = {
    PodState.NEW: frozenset({PodState.HEALTHY, PodState.UNHEALTHY}),
    PodState.HEALTHY: frozenset({PodState.HEALTHY, PodState.UNHEALTHY}),
    PodState.UNHEALTHY: frozenset({PodState.HEALTHY, PodState.UNHEALTHY}),
}


@dataclass(slots=True)
class PodRecord:
    """Mutable per-pod bookkeeping, touched only on the event loop."""

    entry: PodEntry
    channel: grpc.aio.Channel
    state: PodState = PodState.NEW
    report: pdserve_pb2.LoadReport | None = None
    reason: str = "not polled yet"
    failures: int = 0  # consecutive failed polls (in the log line when it goes down)
    absent_since: float | None = None  # monotonic time it went missing from the registry
    watch: LoadWatch | None = None  # its pushed load reports, while the stream lives
    watch_unsupported: bool = False  # an older pod without WatchLoad: polled
    polled_at: float = 0.0  # monotonic time of its last poll
    # `pods()`'s PodLoad, kept while neither `report` nor this router's in-flight
    # count changed: a request's choice at 1,000 pods must not rebuild (and
    # re-validate) 1,000 of them (docs/routing.md, "Choosing among many pods")
    load: PodLoad | None = None
    load_key: tuple[object, int, int] | None = None

    def move(self, new: PodState, reason: str) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise AssertionError(f"pod {self.entry.address}: {self.state} -> {new} not allowed")
        if new is not self.state:
            level = logging.INFO if new is PodState.HEALTHY else logging.WARNING
            log.log(level, "%s pod %s is %s (%s)", self.entry.role, self.entry.address,
                    new.value, reason)
        self.state = new
        self.reason = reason
