"""ColocatedGate: the colocated pods' wait estimate, what it sheds and what it
never sheds, and the 429 it gives (router/routing/colocated_gate.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from router.metrics import RouterMetrics
from router.routing.colocated_gate import ColocatedGate
from router.routing.ledger import MIN_SAMPLES


@dataclass
class _Load:
    address: str
    num_waiting_tokens: int = 0


class _Pool:
    def __init__(self, *loads: _Load) -> None:
        self.loads = list(loads)

    def pods(self, role: str) -> list[_Load]:
        return self.loads if role == "colocated" else []

    def pod(self, role: str, address: str) -> _Load | None:
        return next((p for p in self.pods(role) if p.address == address), None)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _gate(limit: float = 2.0, *loads: _Load):
    clock, metrics = _Clock(), RouterMetrics()
    pool = _Pool(*(loads or (_Load("a"), _Load("b"))))
    return ColocatedGate(pool, metrics, limit, clock=clock), clock, metrics


def _teach(gate: ColocatedGate, clock: _Clock, address: str, tokens: int, seconds: float,
           times: int = MIN_SAMPLES) -> None:
    """`times` prompts of `tokens`, one at a time, each computed in `seconds`."""
    for _ in range(times):
        slot = gate.sent(address, tokens)
        clock.now += seconds
        slot.release(tokens)


def test_an_unknown_rate_sheds_nothing():
    gate, clock, _ = _gate()
    _teach(gate, clock, "a", 1000, 1.0, times=MIN_SAMPLES - 1)
    for _ in range(50):
        gate.sent("a", 1000)
    assert gate.estimated_wait("a") is None
    assert gate.over_limit("a", 1000) is None


def test_wait_is_outstanding_tokens_at_the_learnt_rate():
    gate, clock, _ = _gate(limit=2.0)
    _teach(gate, clock, "a", 500, 1.0)  # 500 tokens/s
    assert gate.estimated_wait("a") == 0.0  # nothing outstanding: an idle pod takes anything
    assert gate.over_limit("a", 5000) is None  # a request that would not wait is never shed
    gate.sent("a", 500)
    assert gate.estimated_wait("a") == pytest.approx(1.0)
    # shed by the wait until its own prompt is computed: 1 s ahead + 500 tokens
    assert gate.over_limit("a", 400) is None
    assert gate.over_limit("a", 600) == pytest.approx(2.2)
    third = gate.sent("a", 1000)
    assert gate.estimated_wait("a") == pytest.approx(3.0)
    assert gate.over_limit("a", 1) == pytest.approx(3.002)
    assert gate.over_limit("b", 1) is None  # another pod's queue is its own
    third.release()  # ended before its first token: counts no throughput
    assert gate.estimated_wait("a") == pytest.approx(1.0)
    third.release(1000)  # a second release is a no-op
    assert gate.estimated_wait("a") == pytest.approx(1.0)


def test_the_pods_reported_queue_counts_when_larger():
    load = _Load("a")
    gate, clock, _ = _gate(2.0, load)
    _teach(gate, clock, "a", 500, 1.0)
    load.num_waiting_tokens = 2000
    assert gate.estimated_wait("a") == 0.0  # a report a poll old, of what the pod has done
    slot = gate.sent("a", 100)
    assert gate.estimated_wait("a") == pytest.approx(4.0)  # other routers' prompts queued there
    load.num_waiting_tokens = 50
    assert gate.estimated_wait("a") == pytest.approx(0.2)
    slot.release(100)
    assert gate.estimated_wait("a") == 0.0


def test_the_rate_learnt_is_per_busy_second_with_prompts_overlapping():
    gate, clock, _ = _gate()
    slots = [gate.sent("a", 300) for _ in range(MIN_SAMPLES)]
    for slot in slots:  # computed together: one first token per second
        clock.now += 1.0
        slot.release(300)
    clock.now += 60.0  # idle time is not busy time
    gate.sent("a", 600)
    assert gate.estimated_wait("a") == pytest.approx(2.0)  # 300 tokens/s


def test_429_names_the_wait_the_pod_and_the_limit():
    gate, clock, metrics = _gate(limit=1.5)
    _teach(gate, clock, "a", 1000, 1.0)
    _teach(gate, clock, "b", 1000, 1.0)
    for _ in range(3):
        gate.sent("a", 1000)
    for _ in range(5):
        gate.sent("b", 1000)
    waits = {a: gate.over_limit(a, 600) for a in ("a", "b")}
    error = gate.overloaded(waits, 600)
    assert error.status == 429 and error.code == "queue_full"
    assert error.message == (
        "server overloaded: the estimated wait at colocated pod a is 3.6s until this prompt "
        "is computed (3000 prompt tokens sent there and not yet computed, and its own 600), "
        "above the limit --max-queue-wait 1.5s; retry later")
    assert error.retry_after == 3
    assert metrics.registry.get_sample_value("pdserve_router_queue_rejected_total") == 1
    assert metrics.registry.get_sample_value(
        "pdserve_router_queue_estimated_wait_seconds", {"pod": "b"}) == pytest.approx(5.0)
    assert metrics.registry.get_sample_value(
        "pdserve_router_queue_dispatched_tokens", {"pod": "a"}) == 3000


def test_the_limit_must_be_positive():
    with pytest.raises(ValueError, match=r"max queue wait must be in \(0, 86400\]"):
        ColocatedGate(_Pool(), RouterMetrics(), 0.0)
