"""The router's Prometheus metrics, on a registry owned by the router server.

Names follow DESIGN.md ("Interfaces users see"); latency histograms carry
`role="router"` because pods export the same names with their own role, and
the router's also `path`: which way the request went (`PATHS`, the values of
the trace attribute `path`, router/flow/tracing.py). A request's flow binds
its path's children once, at its first token (`for_path`), so the per-token
ITL observation costs what it did with one child.
`RouterServer` creates one `RouterMetrics` (no module-global registry, so
tests can run several routers in one process); `router.flow` observes into
it from the event loop, and `/metrics` renders it.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a routing decision is microseconds of Python (plus a session-store read
# for sticky sessions): 10 us to 100 ms, 1-2.5-5 per decade
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                     0.05, 0.1)
DECISION_ROLES = ("prefill", "decode", "colocated")
# the ways a request goes (one bounded label, never free text): a prefill pod
# and a decode pod; the same with the prompt's tail computed on the decode pod
# (--split-prefill-min-tokens); a decode pod prefilling it itself; a colocated
# pod; a prefill pod scoring the prompt alone (max_tokens 0)
PATHS = ("disaggregated", "split", "local_prefill", "colocated", "scoring")
DEFAULT_PATH = "disaggregated"
ROLE = "router"
CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """Counters and histograms for request flow, retries, migrations and aborts."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: this process is one of several router workers
        whose samples prometheus_client keeps in that directory (its
        multiprocess mode, enabled by the CLI before this module is imported);
        `render` then sums every worker's."""
        self.registry = registry or CollectorRegistry()
        self._multiprocess_dir = multiprocess_dir
        r = self.registry
        ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Request arrival to first token sent",
            ["role", "path"], buckets=_LATENCY_BUCKETS, registry=r)
        itl = Histogram(
            "pdserve_inter_token_latency_seconds", "Time between consecutive output tokens",
            ["role", "path"], buckets=_LATENCY_BUCKETS, registry=r)
        e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "Request arrival to its last token",
            ["role", "path"], buckets=_LATENCY_BUCKETS, registry=r)
        # every path's children exist from the start (a dashboard's query finds
        # each path at 0), and none is made later: the label stays bounded
        self.latency = {path: PathLatency(ttft.labels(role=ROLE, path=path),
                                          LoopHistogram(itl.labels(role=ROLE, path=path)),
                                          e2e.labels(role=ROLE, path=path))
                        for path in PATHS}
        self.retries = Counter(
            "pdserve_retries_total",
            "Pod calls retried on another pod (prefill failed, decode full)",
            ["role"], registry=r,
        )
        self.migrations = Counter(
            "pdserve_migrations_total",
            "Requests moved to a new pod pair after their decode pod failed",
            registry=r,
        )
        self.split_prefills = Counter(
            "pdserve_router_split_prefills_total",
            "Requests whose prompt the prefill pod and the decode pod computed together "
            "(--split-prefill-min-tokens: the head on the prefill pod, the tail on the "
            "decode pod)", registry=r,
        )
        self.local_prefills = Counter(
            "pdserve_router_local_prefills_total",
            "Requests a decode pod prefilled itself (--local-prefill-max-tokens, "
            "--local-prefill-below, --local-prefill-within-budget) instead of the P/D path",
            registry=r,
        )
        self.prefill_warms = Counter(
            "pdserve_router_prefill_warms_total",
            "Turns a decode pod computed itself that their prefill pod then computed in "
            "the background to keep its cache whole (--local-prefill-warm), by outcome: "
            "done, failed, skipped (the pod had a queue, or a warm-up in flight)",
            ["outcome"], registry=r,
        )
        self.local_prefills_from_queue = Counter(
            "pdserve_router_local_prefills_from_queue_total",
            "Of those, requests a decode pod took while they waited in the router's "
            "prefill queue", registry=r,
        )
        self.aborts = Counter(
            "pdserve_aborts_total", "Requests the router aborted on the pods, by reason",
            ["reason"], registry=r,
        )
        self.direct_relayed = Counter(
            "pdserve_router_direct_relayed_tokens_total",
            "Output tokens written to their client by the decode session's reader itself "
            "(the direct relay), not by the request's task", registry=r,
        )
        self.load_reports = Counter(
            "pdserve_router_load_reports_total",
            "Pods' load reports received, by how: streamed (WatchLoad) or polled (GetLoad)",
            ["source"], registry=r,
        )
        self.requests = Counter(
            "pdserve_router_requests_total", "Finished client requests by outcome",
            ["outcome"], registry=r,
        )
        self.in_flight = Gauge(
            "pdserve_router_requests_in_flight", "Client requests being served now", registry=r,
            multiprocess_mode="livesum",  # the live workers' sum (ignored with one process)
        )
        # the admission queue in front of the prefill pods (router/routing/admission.py)
        self.queue_requests = Gauge(
            "pdserve_router_queue_requests",
            "Requests waiting in the router's queue for a prefill pod", ["pod"], registry=r,
        )
        self.queue_tokens = Gauge(
            "pdserve_router_queue_tokens",
            "Tokens to compute (prompt less the expected cache hit) waiting in the router's "
            "queue for a prefill pod", ["pod"], registry=r,
        )
        self.queue_dispatched_tokens = Gauge(
            "pdserve_router_queue_dispatched_tokens",
            "Tokens to compute this router has sent to a prefill pod (or a colocated pod) and "
            "not yet seen finish (the first token)",
            ["pod"], registry=r,
        )
        self.queue_estimated_wait = Gauge(
            "pdserve_router_queue_estimated_wait_seconds",
            "Estimated wait of a request arriving now for a prefill pod, at the pod's peak "
            "throughput plus its share of the decode pods' local prefill rate, or for a "
            "colocated pod at its throughput as it stands (set once its throughput is known)",
            ["pod"], registry=r,
        )
        self.queue_prefill_rate = Gauge(
            "pdserve_router_queue_prefill_tokens_per_second",
            "A prefill (or colocated) pod's computed tokens per busy second, learnt from "
            "finished prefills",
            ["pod"], registry=r,
        )
        self.queue_wait = Histogram(
            "pdserve_router_queue_wait_seconds",
            "Time a request waited in the router's queue before its prefill was sent",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        # RoutingPolicy's choose_* calls, by the role chosen (router/routing/timed.py)
        decisions = Histogram(
            "pdserve_router_routing_decision_seconds",
            "Time the routing policy took to choose a pod, by the role chosen",
            ["role"], buckets=_DECISION_BUCKETS, registry=r,
        )
        self.routing_decision = {role: decisions.labels(role=role) for role in DECISION_ROLES}
        # the same calls' CPU time on the router's thread, less the session
        # store's awaits: the router's own work per decision, which grows with
        # the pods and not with how busy the machine's other processes are
        decisions_cpu = Histogram(
            "pdserve_router_routing_decision_cpu_seconds",
            "CPU time the routing policy's own work took to choose a pod (thread time, "
            "session-store waits excluded), by the role chosen",
            ["role"], buckets=_DECISION_BUCKETS, registry=r,
        )
        self.routing_decision_cpu = {role: decisions_cpu.labels(role=role)
                                     for role in DECISION_ROLES}
        self.queue_rejected = Counter(
            "pdserve_router_queue_rejected_total",
            "Requests refused with 429 because the estimated queue wait was above "
            "--max-queue-wait", registry=r,
        )
        # API keys by name (router/client_gate.py; never the key itself)
        self.key_requests = Counter(
            "pdserve_router_key_requests_total", "Generation requests admitted, by API key name",
            ["key"], registry=r)
        self.key_tokens = Counter(
            "pdserve_router_key_tokens_total",
            "Prompt and output tokens of finished requests, by API key name", ["key"],
            registry=r)
        self.key_rejections = Counter(
            "pdserve_router_key_rejections_total",
            "Requests refused with 429 by their API key's limits: concurrency "
            "(max_concurrent) or token_rate (tokens_per_minute)", ["key", "reason"], registry=r)
        self.key_reloads = Counter(
            "pdserve_router_api_key_reloads_total",
            "Reloads of --api-keys-file after it changed: ok, or error (the previous keys "
            "stay in force)", ["outcome"], registry=r)

        # the prefix index (router/cache_index/): refreshed at every feed sync
        self.cache_index_blocks = Gauge(
            "pdserve_router_cache_index_blocks",
            "Prefix blocks a pod caches as far as its cache events told this router",
            ["pod"], registry=r,
        )
        self.cache_events_missed = Gauge(
            "pdserve_router_cache_events_missed_batches",
            "Cache-event batches this router missed (gaps in the pods' batch numbers)",
            registry=r,
        )

    def for_path(self, path: str | None) -> PathLatency:
        """The latency histograms of requests that went by `path` (one of
        `PATHS`; None, a request that never chose one, counts as the default)."""
        if path is None:
            path = DEFAULT_PATH
        try:
            return self.latency[path]
        except KeyError:
            raise ValueError(f"path {path!r} is not one of {PATHS}") from None

    def bind_pod_queue(self, pod: str, *, dispatched: Callable[[], float],
                       wait: Callable[[], float | None],
                       rate: Callable[[], float | None]) -> None:
        """Bind `pod`'s queue gauges (tokens sent there not yet seen finish,
        the estimated wait, the learnt prefill rate) to functions read when
        /metrics is rendered, on the router's event loop; None reads as NaN
        (not known yet)."""
        def known(read: Callable[[], float | None]) -> Callable[[], float]:
            return lambda: math.nan if (value := read()) is None else value

        self.queue_dispatched_tokens.labels(pod=pod).set_function(dispatched)
        self.queue_estimated_wait.labels(pod=pod).set_function(known(wait))
        self.queue_prefill_rate.labels(pod=pod).set_function(known(rate))

    def render(self) -> bytes:
        """The text exposition format for GET /metrics."""
        for latency in self.latency.values():
            latency.itl.flush()
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self._multiprocess_dir)
        return generate_latest(merged)


class PathLatency:
    """One path's TTFT, ITL and E2E histogram children (`RouterMetrics.for_path`)."""

    __slots__ = ("ttft", "itl", "e2e")

    def __init__(self, ttft, itl: LoopHistogram, e2e) -> None:
        self.ttft = ttft
        self.itl = itl
        self.e2e = e2e


class LoopHistogram:
    """A histogram child observed from the event loop many times an engine
    step: the inter-token latency, one observation per token the router
    relays. `observe` counts into plain lists; the counts go into the
    histogram once per loop iteration (`call_soon`) and before each render.

    Why: prometheus_client's `observe` takes a lock twice (the sum, the
    bucket), 1.2 us here, a tenth of the relay's Python per token
    (benchmarks/results/router-http-2026-11-27-relay-python/README.md). The
    batch goes in through the child's bucket and sum values (`_buckets`,
    `_sum`: prometheus_client's own fields, in its multiprocess mode too); a
    child without them is observed one by one.
    """

    __slots__ = ("_child", "_bounds", "_buckets", "_sum", "_pending", "_pending_sum",
                 "_scheduled")

    def __init__(self, child: Histogram) -> None:
        self._child = child
        bounds = getattr(child, "_upper_bounds", None)
        buckets = getattr(child, "_buckets", None)
        total = getattr(child, "_sum", None)
        fast = (bounds is not None and buckets is not None and total is not None
                and len(bounds) == len(buckets) and bounds[-1] == math.inf)
        self._bounds: list[float] | None = list(bounds) if fast else None
        self._buckets = buckets
        self._sum = total
        self._pending = [0] * len(bounds) if fast else []
        self._pending_sum = 0.0
        self._scheduled = False

    @property
    def batched(self) -> bool:
        """False where prometheus_client lacks the fields: one `observe` each."""
        return self._bounds is not None

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (>= 0, finite)."""
        if self._bounds is None:
            for _ in range(count):
                self._child.observe(value)
            return
        # the first bucket whose upper bound is >= value, as prometheus_client's
        self._pending[bisect.bisect_left(self._bounds, value)] += count
        self._pending_sum += value * count
        if not self._scheduled:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a test, a script): in at once
                self.flush()
                return
            self._scheduled = True

    def flush(self) -> None:
        """Put the pending counts into the histogram."""
        self._scheduled = False
        if self._bounds is None:
            return
        pending = self._pending
        for i, count in enumerate(pending):
            if count:
                self._buckets[i].inc(count)
                pending[i] = 0
        if self._pending_sum:
            self._sum.inc(self._pending_sum)
            self._pending_sum = 0.0
