"""`load_report`: every pod's `GetLoad` answer, built from its engine loop's
live stats and its drain gate. The prefill and decode servicers' `GetLoad`
is this one call; `watch_load` is their `WatchLoad` stream, which the router
keeps open to each pod instead of polling it (DESIGN.md "Routing";
docs/routing.md, "Pod discovery and health").

Why push: a router polling N pods every interval does N health checks and
N GetLoads per interval whether or not anything changed; at 1,000 pods that
took half a core idle and, under load, polls timed out and pods dropped out
in waves (docs/simulator.md). A stream costs nothing while a pod is idle
but a heartbeat, and tells the router of a change within `min_interval`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from engine.engine_loop import EngineLoop
from pod.drain import DrainGate
from proto import pdserve_pb2


def load_report(role: str, model: str, generation: int, loop: EngineLoop,
                gate: DrainGate, cache_events_channel: str = "") -> pdserve_pb2.LoadReport:
    """A snapshot of `loop.stats` plus who this pod is; called on the pod's event loop.
    `cache_events_channel`: the Redis channel of pod/cache_events.py ("" = none)."""
    stats = loop.stats
    return pdserve_pb2.LoadReport(
        role=role,
        generation=generation,
        num_waiting=stats.num_waiting,
        num_waiting_tokens=stats.num_waiting_tokens,
        num_running=stats.num_running,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        block_size=loop.block_size,
        prefix_hit_rate=(stats.prefix_cache_hits / stats.prefix_cache_queries
                         if stats.prefix_cache_queries else 0.0),
        model=model,
        max_model_len=loop.max_model_len,
        draining=gate.draining,
        cache_events_channel=cache_events_channel,
        device=loop.device_type,
        tensor_parallel_size=loop.tensor_parallel_size,
    )


DEFAULT_MIN_INTERVAL_S = 0.05
DEFAULT_MAX_INTERVAL_S = 2.0
_INTERVAL_BOUNDS = (0.01, 60.0)


def watch_intervals(request: pdserve_pb2.WatchLoadRequest) -> tuple[float, float]:
    """(min, max) interval of a WatchLoad request: 0 takes the defaults, the rest
    is clamped to [0.01, 60] s, and the heartbeat is never more often than the
    change check."""
    low, high = _INTERVAL_BOUNDS
    min_s = request.min_interval_s or DEFAULT_MIN_INTERVAL_S
    max_s = request.max_interval_s or DEFAULT_MAX_INTERVAL_S
    min_s = min(max(min_s, low), high)
    return min_s, min(max(max_s, min_s), high)


async def watch_load(build: Callable[[], pdserve_pb2.LoadReport], loop: EngineLoop,
                     gate: DrainGate, request: pdserve_pb2.WatchLoadRequest
                     ) -> AsyncIterator[pdserve_pb2.LoadReport]:
    """WatchLoad: `build()`'s report at once, then whenever it differs from the
    last one sent, checked every min interval, and at least every max interval.

    A check is one identity test while nothing happens: the engine loop
    replaces `loop.stats` after every step, so a report is rebuilt only when
    the stats object or the drain state is new. A draining pod's report goes
    out at the next check and ends the stream: the router stops routing to the
    pod, and no open stream holds up the pod's shutdown."""
    min_s, max_s = watch_intervals(request)
    report = build()
    yield report
    if report.draining:
        return  # the router takes no new work here; an open stream would delay shutdown
    sent_at, seen = time.monotonic(), (loop.stats, gate.draining)
    while True:
        await asyncio.sleep(min_s)
        now, state = time.monotonic(), (loop.stats, gate.draining)
        changed = state[0] is not seen[0] or state[1] != seen[1]
        if not changed and now - sent_at < max_s:
            continue
        seen = state
        fresh = build()
        if fresh != report or now - sent_at >= max_s:
            report, sent_at = fresh, now
            yield report
            if report.draining:
                return
