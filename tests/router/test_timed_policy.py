"""TimedRoutingPolicy (router/routing/timed.py): the same choices as
`RoutingPolicy`, each one observed into the router's real
pdserve_router_routing_decision_seconds histogram under the role chosen, a
refusal included. The live /metrics page carries the family
(tests/observability/test_chart_autoscaling.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from router.metrics import RouterMetrics
from router.routing.base import NoPodAvailable
from router.routing.policy import RoutingPolicy
from router.routing.timed import TimedRoutingPolicy
from router.sessions import InMemorySessionStore
from tests.router.test_policy import DECODE, PREFILL, SnapshotPool, load

NAME = "pdserve_router_routing_decision_seconds"
CPU_NAME = "pdserve_router_routing_decision_cpu_seconds"


def _pool() -> SnapshotPool:
    return SnapshotPool([load(a, "prefill") for a in PREFILL]
                        + [load(a, "decode") for a in DECODE]
                        + [load("127.0.0.1:8001", "colocated")])


def _count(registry: CollectorRegistry, role: str) -> float:
    return registry.get_sample_value(f"{NAME}_count", {"role": role}) or 0.0


def test_choices_are_the_policys_and_each_is_observed_by_role() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    timed = TimedRoutingPolicy(_pool(), InMemorySessionStore(),
                               decision_seconds=metrics.routing_decision)
    plain = RoutingPolicy(_pool(), InMemorySessionStore())

    async def both(method: str, **kw: object) -> tuple[str, str]:
        return await getattr(timed, method)(**kw), await getattr(plain, method)(**kw)

    for i in range(5):
        prompt = list(range(i, i + 100))
        got, want = asyncio.run(both("choose_prefill", session_id=f"s{i}",
                                     prompt_token_ids=prompt))
        assert got == want
    got, want = asyncio.run(both("choose_colocated", session_id=None, prompt_token_ids=[1, 2]))
    assert got == want == "127.0.0.1:8001"
    assert timed.choose_decode(num_tokens=64) == plain.choose_decode(num_tokens=64)

    assert {r: _count(registry, r) for r in ("prefill", "decode", "colocated")} == {
        "prefill": 5.0, "decode": 1.0, "colocated": 1.0}
    # every decision took some time, and far less than the top bucket's 100 ms
    assert registry.get_sample_value(f"{NAME}_sum", {"role": "prefill"}) > 0.0
    assert registry.get_sample_value(f"{NAME}_bucket", {"role": "decode", "le": "0.1"}) == 1.0
    assert registry.get_sample_value(f"{NAME}_bucket", {"role": "decode", "le": "1e-05"}) \
        is not None  # the finest bucket is 10 us


def test_a_refusal_is_a_timed_decision() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    timed = TimedRoutingPolicy(_pool(), InMemorySessionStore(),
                               decision_seconds=metrics.routing_decision)
    with pytest.raises(NoPodAvailable):
        timed.choose_decode(num_tokens=64, exclude=frozenset(DECODE))
    assert _count(registry, "decode") == 1.0


def test_every_role_needs_a_histogram() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    partial = {"prefill": metrics.routing_decision["prefill"]}
    with pytest.raises(ValueError, match=r"roles \['colocated', 'decode'\]"):
        TimedRoutingPolicy(_pool(), InMemorySessionStore(), decision_seconds=partial)


def test_the_cpu_histogram_leaves_out_what_runs_while_the_session_store_answers() -> None:
    """A store call during which 50 ms of CPU time pass on the router's thread
    (as other requests' work does while the store answers): the decision's
    wall time counts them, its CPU time not."""

    class BusyStore(InMemorySessionStore):
        async def get(self, role: str, session_id: str) -> str | None:
            other = asyncio.get_running_loop().create_task(asyncio.to_thread(lambda: None))
            spin = time.thread_time() + 0.05
            while time.thread_time() < spin:  # the thread busy while the store answers
                pass
            await other
            return await super().get(role, session_id)

    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    timed = TimedRoutingPolicy(_pool(), BusyStore(), decision_seconds=metrics.routing_decision,
                               decision_cpu_seconds=metrics.routing_decision_cpu)
    asyncio.run(timed.choose_prefill(session_id="s", prompt_token_ids=list(range(100))))
    wall = registry.get_sample_value(f"{NAME}_sum", {"role": "prefill"})
    cpu = registry.get_sample_value(f"{CPU_NAME}_sum", {"role": "prefill"})
    assert wall >= 0.05
    assert 0.0 < cpu < 0.05
    assert timed.choose_decode(num_tokens=64) in DECODE
    assert registry.get_sample_value(f"{CPU_NAME}_count", {"role": "decode"}) == 1.0
