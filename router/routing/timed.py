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
    """`RoutingPolicy` that observes each choice's duration into `decision_seconds`,
    a histogram child per role chosen: "prefill", "decode", "colocated"."""

    def __init__(self, *args: Any, decision_seconds: Mapping[str, Observer],
                 **kwargs: Any) -> None:
        missing = {"prefill", "decode", "colocated"} - set(decision_seconds)
        if missing:
            raise ValueError(f"decision_seconds needs a histogram for roles {sorted(missing)}")
        super().__init__(*args, **kwargs)
        self._decision_seconds = decision_seconds

    async def choose_prefill(self, *args: Any, **kwargs: Any) -> str:
        start = time.perf_counter()
        try:
            return await super().choose_prefill(*args, **kwargs)
        finally:
            self._decision_seconds["prefill"].observe(time.perf_counter() - start)

    async def choose_colocated(self, *args: Any, **kwargs: Any) -> str:
        start = time.perf_counter()
        try:
            return await super().choose_colocated(*args, **kwargs)
        finally:
            self._decision_seconds["colocated"].observe(time.perf_counter() - start)

    def choose_decode(self, *args: Any, **kwargs: Any) -> str:
        start = time.perf_counter()
        try:
            return super().choose_decode(*args, **kwargs)
        finally:
            self._decision_seconds["decode"].observe(time.perf_counter() - start)
