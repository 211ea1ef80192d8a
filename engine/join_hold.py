"""`JoinHold`: on a decode pod, the engine loop may hold a step's start for a
transfer about to complete (`--join-wait`).

Why: a transferred request's second token needs its first as input, so it
joins the first step that starts after its commit. When the commit lands
while a step runs, the request waits for the rest of that step and then one
more: 1.5 steps on average where the gap between its other tokens is one.

The rule: before a step starts, ask which transfer is expected to complete
next and when (`next_ready`, the decode pod's
`decode_service.transfer_eta.TransferETA`). If that is within `fraction` of
a step (the steps' moving average), hold the start, running commands
meanwhile, until that request's commit has run (it is no longer expected),
or that much time passed; once per request. A held request's gap is then
about one step, and the running batch pays at most `fraction` of a step
once per joining request (metrics `pdserve_join_holds_total`,
`pdserve_join_hold_seconds_total`).

Threads: the engine loop thread calls both methods (it is the loop's
`engine.engine_loop.StepHook`); `next_ready` must be callable from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.metrics import PodMetrics

# Weight of the latest step in the steps' moving average.
_STEP_EMA_ALPHA = 0.25

# () -> (request id, time.monotonic() when it is expected to complete), or None
NextReady = Callable[[], tuple[str, float] | None]


class JoinHold:
    """A decode pod's `StepHook`: holds a step's start up to `fraction` (0-1)
    of a step for the request `next_ready()` expects first; 0 turns it off."""

    def __init__(self, next_ready: NextReady, fraction: float, metrics: PodMetrics) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"join fraction must be in [0, 1] of a step, got {fraction}")
        self._next_ready = next_ready
        self._fraction = fraction
        self._metrics = metrics
        self._step_s = 0.0  # moving average of step() wall time
        self._held_for: str | None = None  # the last request held for (once each)

    def after_step(self, seconds: float) -> None:
        self._step_s += (_STEP_EMA_ALPHA if self._step_s else 1.0) * (seconds - self._step_s)

    def before_step(self, wait: Callable[[float], bool]) -> None:
        """Wait (`wait` runs the loop's commands) for the commit of the
        transfer expected next, if it is due within the join fraction of a
        step; once per request."""
        if self._fraction == 0:
            return
        expected = self._next_ready()
        if expected is None or expected[0] == self._held_for:
            return
        request_id, ready_at = expected
        started = time.monotonic()
        budget = self._fraction * self._step_s
        if budget <= 0 or ready_at - started > budget:
            return
        self._held_for = request_id
        deadline = started + budget
        while (left := deadline - time.monotonic()) > 0:
            if not wait(left):
                break  # the loop is stopping
            expected = self._next_ready()
            if expected is None or expected[0] != request_id:
                break  # its commit is queued (and ran), or it failed
        self._metrics.join_holds.inc()
        self._metrics.join_hold_seconds.inc(time.monotonic() - started)
