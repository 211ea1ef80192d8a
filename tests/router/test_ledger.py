"""PodLedger: outstanding work per pod, busy time, the learnt throughput, the
release-once slot, and the shedding decision."""

from __future__ import annotations

import pytest

from router.metrics import RouterMetrics
from router.routing.ledger import MIN_SAMPLES, PodLedger, ShedLimit


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_slot_counts_once_and_the_rate_learns_from_busy_time_only():
    clock, released = _Clock(), []
    ledger = PodLedger(clock, on_release=lambda work: released.append(work.tokens))
    for _ in range(MIN_SAMPLES):
        first, second = ledger.send("a", 300), ledger.send("a", 100)
        assert (ledger.get("a").tokens, ledger.get("a").oldest_tokens) == (400, 300)
        clock.now += 1.0
        first.release(100)  # a cache hit: it computed 100 of its 300
        first.release(100)  # a no-op
        clock.now += 1.0
        second.release(100)
        clock.now += 60.0  # idle: not busy time
    work = ledger.get("a")
    assert (work.tokens, work.outstanding, released) == (0, {}, [100, 0] * MIN_SAMPLES)
    assert work.throughput.tokens_per_s == pytest.approx(100.0)  # 100 tokens per busy second
    assert work.wait(400, peak=False) == pytest.approx(4.0)
    assert work.wait(400, peak=False, extra_rate=100.0) == pytest.approx(2.0)
    assert ledger.get("b") is None and PodLedger(clock).pod("b").wait(1, peak=True) is None


def test_a_failed_slot_teaches_nothing():
    ledger = PodLedger(_Clock())
    for _ in range(MIN_SAMPLES):
        ledger.send("a", 100).release()
    assert ledger.get("a").throughput.samples == 0


def test_the_shed_limit_refuses_above_it_only_and_counts():
    metrics = RouterMetrics()
    limit = ShedLimit(2.0, metrics)
    assert not limit.exceeded(None) and not limit.exceeded(2.0) and limit.exceeded(2.5)
    error = limit.refuse(4.2, "a wait")
    assert (error.status, error.retry_after) == (429, 3)
    assert error.message == ("server overloaded: a wait, above the limit "
                                  "--max-queue-wait 2s; retry later")
    assert metrics.registry.get_sample_value("pdserve_router_queue_rejected_total") == 1
