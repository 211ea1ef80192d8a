"""`TimedRoutingPolicy`: a `RoutingPolicy` whose choices are timed.

`RouterServer` builds it in place of `RoutingPolicy` so that every
`choose_prefill`, `choose_colocated` and `choose_decode` call, from the
request flow and from prefill admission alike, is observed into
`pdserve_router_routing_decision_seconds{role}` (router/metrics.py). The
rules stay in router/routing/policy.py; this module only wraps the calls,
so it needs no change when their arguments do.

What a decision's time includes: the candidate scan and the ranking, and for
a request with a session id the session store's read and write (Redis when
the router has one), since that is part of choosing. A call that raises
`NoPodAvailable` is timed too: a refusal is a decision. Observed on the
router's event loop, where every choice is made.

Its CPU time (`pdserve_router_routing_decision_cpu_seconds`, thread time)
is the policy's own work: the thread time that passed while a call awaited
the session store is taken out, since other requests' work runs on the
thread meanwhile (`RoutingPolicy.store_cpu_s`). Wall time and CPU time part
where the router's cores are shared: a decision preempted by another
process takes wall time but no CPU time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from router.routing.policy import RoutingPolicy


class Observer(Protocol):
    """A histogram child (`prometheus_client`'s labelled Histogram)."""

    def observe(self, amount: float) -> None: ...


class TimedRoutingPolicy(RoutingPolicy):
    """`RoutingPolicy` that observes each choice's duration into `decision_seconds`
    and its CPU time into `decision_cpu_seconds` (when given), a histogram
    child per role chosen: "prefill", "decode", "colocated"."""

    def __init__(self, *args: Any, decision_seconds: Mapping[str, Observer],
                 decision_cpu_seconds: Mapping[str, Observer] | None = None,
                 **kwargs: Any) -> None:
        given = {"decision_seconds": decision_seconds, "decision_cpu_seconds": decision_cpu_seconds}
        for name, histograms in given.items():
            missing = _ROLES - set(_ROLES if histograms is None else histograms)
            if missing:
                raise ValueError(f"{name} needs a histogram for roles {sorted(missing)}")
        super().__init__(*args, **kwargs)
        self._decision_seconds = decision_seconds
        self._decision_cpu_seconds = decision_cpu_seconds

    async def choose_prefill(self, *args: Any, **kwargs: Any) -> str:
        timing = self._start()
        try:
            return await super().choose_prefill(*args, **kwargs)
        finally:
            self._observe("prefill", timing)

    async def choose_colocated(self, *args: Any, **kwargs: Any) -> str:
        timing = self._start()
        try:
            return await super().choose_colocated(*args, **kwargs)
        finally:
            self._observe("colocated", timing)

    def choose_decode(self, *args: Any, **kwargs: Any) -> str:
        timing = self._start()
        try:
            return super().choose_decode(*args, **kwargs)
        finally:
            self._observe("decode", timing)

    def _start(self) -> tuple[float, float, float]:
        return time.perf_counter(), time.thread_time(), self.store_cpu_s

    def _observe(self, role: str, timing: tuple[float, float, float]) -> None:
        wall, cpu, store_cpu = timing
        self._decision_seconds[role].observe(time.perf_counter() - wall)
        if self._decision_cpu_seconds is not None:
            own = time.thread_time() - cpu - (self.store_cpu_s - store_cpu)
            self._decision_cpu_seconds[role].observe(max(0.0, own))


_ROLES = frozenset({"prefill", "decode", "colocated"})
