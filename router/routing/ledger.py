"""`PodLedger`: the work this router has sent each pod and not yet seen
finish, and what it learnt of each pod's prefill speed; the one per-pod
account behind prefill admission (router/routing/admission.py), the
colocated gate (router/routing/colocated_gate.py) and local prefill
(router/routing/local_prefill.py), and the one shedding decision.

Life of one piece of work (a prompt to compute), on the router's event loop:

    PodLedger.send(address, tokens) -> WorkSlot   counted as outstanding at
        │                                          the pod; the pod is busy
        │ slot.release(computed_tokens)  its first token is in: the pod's
        │                                throughput learns from it
        │ slot.release()                 it failed or ended before that
        v
    released (once: later calls are no-ops, so a slot may also sit on an
    exit stack for the failure path); the ledger's `on_release` hook runs
    (the admission queue dispatches its next waiter, local prefill frees a
    decode pod's budget)

Throughput: tokens computed (a prompt less the pod's reported cache hit)
per second of busy time, time the pod had work of this router outstanding,
as an exponentially weighted ratio (`_DECAY`), so it follows load changes
within a few prompts. Unknown until `MIN_SAMPLES` prompts finished: a pod's
first ones pay for its warm-up (kernel compilation, allocator growth). Its
peak, decaying by half every `PEAK_HALF_LIFE_S`, is the rate a pod shows
with company (a deep queue is served in full steps).

Wait: tokens ahead / a rate, None while the rate is unknown (`PodWork.wait`).
Which tokens and which rate is each user's rule (their module docstrings).

Shedding (`ShedLimit`, --max-queue-wait): a request whose estimated wait
until its own prompt is computed is above the limit is refused with 429 and
Retry-After, counted in `pdserve_router_queue_rejected_total`; an unknown
wait is never above it.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.api_error import ApiError
from router.metrics import RouterMetrics

# Weight of the history in the throughput estimate at each finished prompt.
_DECAY = 0.8
# Finished prompts before a pod's throughput is trusted (its warm-up is in the first ones).
MIN_SAMPLES = 3
# The throughput's peak, which estimates waits where shedding asks, halves over this many seconds.
PEAK_HALF_LIFE_S = 300.0
# Local prefills count toward the decode pods' prefill rate for this long.
LOCAL_RATE_WINDOW_S = 20.0


def _monotonic() -> float:
    return time.monotonic()  # looked up at each call (tests replace time.monotonic)


class Throughput:
    """Prompt tokens per second of busy time (time with work outstanding)."""

    def __init__(self) -> None:
        self._tokens = 0.0
        self._busy_s = 0.0
        self._pending_busy_s = 0.0  # busy time since the last finished prompt
        self._busy_since: float | None = None
        self.samples = 0  # finished prompts seen
        self._peak = 0.0  # tokens_per_s's peak, as of _peak_at
        self._peak_at = 0.0

    def set_busy(self, busy: bool, now: float) -> None:
        if busy and self._busy_since is None:
            self._busy_since = now
        elif not busy and self._busy_since is not None:
            self._pending_busy_s += now - self._busy_since
            self._busy_since = None

    def finished(self, num_tokens: int, now: float) -> None:
        if self._busy_since is not None:
            self._pending_busy_s += now - self._busy_since
            self._busy_since = now
        self._tokens = self._tokens * _DECAY + num_tokens
        self._busy_s = self._busy_s * _DECAY + self._pending_busy_s
        self._pending_busy_s = 0.0
        self.samples += 1
        peak = self.peak_tokens_per_s(now)  # never below the rate as it stands
        if peak is not None:
            self._peak, self._peak_at = peak, now

    @property
    def tokens_per_s(self) -> float | None:
        """None until `MIN_SAMPLES` prompts finished (or without busy time)."""
        if self.samples < MIN_SAMPLES or self._tokens <= 0 or self._busy_s <= 0:
            return None
        return self._tokens / self._busy_s

    def peak_tokens_per_s(self, now: float) -> float | None:
        """The highest `tokens_per_s` so far, halved every `PEAK_HALF_LIFE_S`
        since it was seen, and never below the rate as it stands; None while
        that is unknown."""
        rate = self.tokens_per_s
        if rate is None:
            return None
        decayed = self._peak * 0.5 ** (max(0.0, now - self._peak_at) / PEAK_HALF_LIFE_S)
        return max(rate, decayed)


class LocalRate:
    """Prompt tokens that decode pods took to prefill themselves, at arrival
    or from the prefill queue, as a rate over the last `LOCAL_RATE_WINDOW_S`
    seconds: the idle side's share of the prefill work, which the admission's
    wait estimate adds to the prefill pods' rate. A window that started less
    than that ago reads low, so the estimate then errs toward the prefill
    pods' rate alone."""

    def __init__(self) -> None:
        self._taken: collections.deque[tuple[float, int]] = collections.deque()
        self._tokens = 0

    def took(self, num_tokens: int, now: float) -> None:
        self._taken.append((now, num_tokens))
        self._tokens += num_tokens

    def tokens_per_s(self, now: float) -> float:
        horizon = now - LOCAL_RATE_WINDOW_S
        while self._taken and self._taken[0][0] <= horizon:
            self._tokens -= self._taken.popleft()[1]
        return self._tokens / LOCAL_RATE_WINDOW_S


class WorkSlot:
    """One prompt's place at its pod from `PodLedger.send` until `release`,
    which counts exactly once (later calls are no-ops)."""

    __slots__ = ("address", "num_tokens", "number", "_work", "_released")

    def __init__(self, work: PodWork, num_tokens: int, number: int) -> None:
        self.address = work.address
        self.num_tokens = num_tokens
        self.number = number  # its place in the pod's send order
        self._work = work
        self._released = False

    def release(self, finished_tokens: int | None = None) -> None:
        """The prompt is computed (`finished_tokens`: what the pod computed
        for it, which its throughput learns from), or it failed or was left
        (None)."""
        if not self._released:
            self._released = True
            self._work.finish(self, finished_tokens)


class PodWork:
    """One pod's outstanding work and throughput, as this router sees it."""

    def __init__(self, ledger: PodLedger, address: str) -> None:
        self.address = address
        self._ledger = ledger
        # send number -> tokens, oldest first (the one the pod computes)
        self.outstanding: dict[int, int] = {}
        self.tokens = 0  # the sum of `outstanding`
        self._next_number = 0
        self.throughput = Throughput()

    @property
    def oldest_tokens(self) -> int:
        """The oldest outstanding prompt's tokens (0 when none)."""
        return next(iter(self.outstanding.values()), 0)

    def send(self, num_tokens: int) -> WorkSlot:
        number = self._next_number
        self._next_number += 1
        self.outstanding[number] = num_tokens
        self.tokens += num_tokens
        self.throughput.set_busy(True, self._ledger.clock())
        return WorkSlot(self, num_tokens, number)

    def finish(self, slot: WorkSlot, finished_tokens: int | None) -> None:
        """`slot`'s work is over (called by `WorkSlot.release`, once)."""
        now = self._ledger.clock()
        self.tokens -= self.outstanding.pop(slot.number)
        if finished_tokens is not None:
            self.throughput.finished(finished_tokens, now)
        self.throughput.set_busy(bool(self.outstanding), now)
        self._ledger.on_release(self)

    def wait(self, tokens: int, *, peak: bool, extra_rate: float = 0.0) -> float | None:
        """Seconds `tokens` take at this pod's throughput (its peak with
        `peak`, else as it stands) plus `extra_rate`; None while unknown."""
        rate = (self.throughput.peak_tokens_per_s(self._ledger.clock()) if peak
                else self.throughput.tokens_per_s)
        return None if rate is None else tokens / (rate + extra_rate)


class PodLedger:
    """`PodWork` per pod address; one per user (admission, colocated gate,
    local prefill), on the router's event loop only. `on_new(work)` runs
    when a pod's account opens (its gauges are bound there), `on_release(work)`
    after each release."""

    def __init__(self, clock: Callable[[], float] = _monotonic,
                 on_new: Callable[[PodWork], None] | None = None,
                 on_release: Callable[[PodWork], None] | None = None) -> None:
        self.clock = clock
        self._on_new = on_new
        self._on_release = on_release
        self._pods: dict[str, PodWork] = {}

    def get(self, address: str) -> PodWork | None:
        return self._pods.get(address)

    def pod(self, address: str) -> PodWork:
        work = self._pods.get(address)
        if work is None:
            work = self._pods[address] = PodWork(self, address)
            if self._on_new is not None:
                self._on_new(work)
        return work

    def send(self, address: str, num_tokens: int) -> WorkSlot:
        """Count `num_tokens` outstanding at `address` until the slot is released."""
        return self.pod(address).send(num_tokens)

    def on_release(self, work: PodWork) -> None:
        if self._on_release is not None:
            self._on_release(work)


@dataclass(frozen=True, slots=True)
class ShedLimit:
    """--max-queue-wait, the one shedding decision of the P/D queue and the
    colocated gate: `exceeded` says whether an estimated wait (until the
    request's own prompt is computed) is above it, `refuse` is the 429."""

    seconds: float
    metrics: RouterMetrics

    def exceeded(self, wait: float | None) -> bool:
        """An unknown wait (the pod's rate not yet learnt) never is."""
        return wait is not None and wait > self.seconds

    def refuse(self, wait: float, what: str) -> ApiError:
        """The 429 for a request refused because `what` (its estimated wait,
        `wait` seconds, and what makes it up) is above the limit; counted."""
        self.metrics.queue_rejected.inc()
        return ApiError(
            429, f"server overloaded: {what}, above the limit --max-queue-wait "
                 f"{self.seconds:g}s; retry later",
            code="queue_full", error_type="overloaded_error",
            retry_after=max(1, math.ceil(wait - self.seconds)),
        )
