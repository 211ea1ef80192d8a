"""Token-level load gauges of a pod: what an autoscaler and a dashboard need
beyond request counts (issue 39).

Who uses it: `PodMetrics` (engine/metrics.py) owns one `TokenGauges`; the
engine loop hands it the engine after each step and each command
(`PodMetrics.publish_tokens`), on the loop thread, so reading the
scheduler's queues needs no lock. It sets

- prompt tokens still to compute after the cached prefix (waiting requests,
  and running ones whose prompt is not all computed: chunked or split
  prefill on a decode pod);
- the running sequences' context tokens;
- the KV cache's used fraction;
- each request's queue wait (arrival in the engine until its first step),
  into a histogram and a sliding window whose median a gauge computes when
  /metrics is scraped.

Cost: the sums walk the waiting and running queues, and the prefix lookup
hashes a waiting prompt once (the scheduler reuses the hashes), so they are
refreshed at most every `min_interval` seconds, never per token; the queue
wait bookkeeping is O(waiting) per call.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# A queue-wait sample older than this leaves the p50 window.
WAIT_WINDOW_SECONDS = 60.0
# At most this many samples in the window (the newest kept): bounded memory
# under any arrival rate.
WAIT_WINDOW_SAMPLES = 4096


class WaitWindow:
    """The queue waits of the last `seconds`, at most `capacity` of them;
    `add` from the engine loop, `median` from the metrics thread."""

    def __init__(self, seconds: float = WAIT_WINDOW_SECONDS,
                 capacity: int = WAIT_WINDOW_SAMPLES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if seconds <= 0 or capacity < 1:
            raise ValueError(f"wait window needs seconds > 0 and capacity >= 1, "
                             f"got {seconds} and {capacity}")
        self._seconds = seconds
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, wait: float) -> None:
        with self._lock:
            self._samples.append((self._clock(), wait))

    def median(self) -> float:
        """p50 of the waits within the window; NaN when there are none
        (nothing was admitted lately: unknown, not zero)."""
        horizon = self._clock() - self._seconds
        with self._lock:
            while self._samples and self._samples[0][0] < horizon:
                self._samples.popleft()
            waits = sorted(w for _, w in self._samples)
        if not waits:
            return math.nan
        mid = len(waits) // 2
        return waits[mid] if len(waits) % 2 else (waits[mid - 1] + waits[mid]) / 2


class QueueWaitTracker:
    """When each request entered the waiting queue, until its first step.

    The engine keeps no arrival time, so the tracker notes the first call
    that sees a never-scheduled request waiting; since the loop publishes
    right after the command that added it, that is its arrival (within one
    command). A request that left the queue scheduled yields its wait; one
    that left unscheduled (aborted) yields none; a preempted request that
    waits again is not counted twice (it was scheduled before).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: dict[str, tuple[Any, float]] = {}

    def update(self, waiting: Iterable[Any]) -> list[float]:
        """The waits of requests that left the queue since the last call."""
        now = self._clock()
        present = set()
        for request in waiting:
            rid = request.request_id
            present.add(rid)
            if not request.was_scheduled and rid not in self._since:
                self._since[rid] = (request, now)
        waits = []
        for rid in [r for r in self._since if r not in present]:
            request, since = self._since.pop(rid)
            if request.was_scheduled:
                waits.append(now - since)
        return waits


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """One reading of the engine's queues."""

    prompt_tokens_waiting: int
    running_context_tokens: int


def count_tokens(engine: Any) -> TokenCounts:
    """Prompt tokens left to compute and context tokens held (loop thread).

    A waiting request that holds no blocks yet will map its cached prefix
    (scheduler._admit_short's rule), so that part is not work; a running
    request's prompt left is its arrival context less what is computed."""
    scheduler = engine.scheduler
    bm = engine.block_manager
    waiting = 0
    for r in scheduler.waiting:
        cached = 0 if r.block_ids else bm.num_cached_prefix_tokens(r)
        waiting += max(0, r.num_tokens - r.num_computed_tokens - cached)
    running = 0
    for r in scheduler.running:
        waiting += max(0, r.num_context_tokens - r.num_computed_tokens)
        running += r.num_tokens
    return TokenCounts(prompt_tokens_waiting=waiting, running_context_tokens=running)


class TokenGauges:
    """Feeds one pod's token gauges (children already bound to its role)."""

    def __init__(self, *, prompt_tokens_waiting: Any, running_context_tokens: Any,
                 kv_cache_usage: Any, queue_wait: Any, queue_wait_p50: Any,
                 min_interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._prompt_tokens_waiting = prompt_tokens_waiting
        self._running_context_tokens = running_context_tokens
        self._kv_cache_usage = kv_cache_usage
        self._queue_wait = queue_wait
        self.window = WaitWindow(clock=clock)
        self._tracker = QueueWaitTracker(clock)
        self._min_interval = min_interval
        self._clock = clock
        self._next_count = -math.inf
        queue_wait_p50.set_function(self.window.median)

    def publish(self, engine: Any, stats: Any) -> None:
        """After a step or a command, on the engine loop thread."""
        for wait in self._tracker.update(engine.scheduler.waiting):
            self._queue_wait.observe(wait)
            self.window.add(wait)
        total = stats.num_total_blocks
        used = total - stats.num_free_blocks
        self._kv_cache_usage.set(used / total if total > 0 else 0.0)
        now = self._clock()
        scheduler = engine.scheduler
        # an idle engine always publishes (its zeros are free to count)
        if now < self._next_count and (scheduler.waiting or scheduler.running):
            return
        self._next_count = now + self._min_interval
        counts = count_tokens(engine)
        self._prompt_tokens_waiting.set(counts.prompt_tokens_waiting)
        self._running_context_tokens.set(counts.running_context_tokens)

    def refresh_now(self) -> None:
        """The next `publish` recounts the queues whatever the interval."""
        self._next_count = -math.inf
