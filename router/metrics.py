"""The router's Prometheus metrics, on a registry owned by the router server.

Names follow DESIGN.md ("Interfaces users see"); latency histograms carry
`role="router"` because pods export the same names with their own role.
`RouterServer` creates one `RouterMetrics` (no module-global registry, so
tests can run several routers in one process); `router.flow` observes into
it from the event loop, and `/metrics` renders it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
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
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Request arrival to first token sent",
            ["role"], buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(role=ROLE)
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds", "Time between consecutive output tokens",
            ["role"], buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(role=ROLE)
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "Request arrival to its last token",
            ["role"], buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(role=ROLE)
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
        self.local_prefills = Counter(
            "pdserve_router_local_prefills_total",
            "Requests a decode pod prefilled itself (--local-prefill-max-tokens) instead "
            "of the P/D path", registry=r,
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
            "Tokens to compute this router has sent to a prefill pod and not yet seen finish",
            ["pod"], registry=r,
        )
        self.queue_estimated_wait = Gauge(
            "pdserve_router_queue_estimated_wait_seconds",
            "Estimated wait of a request arriving now for a prefill pod, at the pod's peak "
            "throughput plus its share of the decode pods' local prefill rate (set once its "
            "throughput is known)", ["pod"], registry=r,
        )
        self.queue_prefill_rate = Gauge(
            "pdserve_router_queue_prefill_tokens_per_second",
            "A prefill pod's computed tokens per busy second, learnt from finished prefills",
            ["pod"], registry=r,
        )
        self.queue_wait = Histogram(
            "pdserve_router_queue_wait_seconds",
            "Time a request waited in the router's queue before its prefill was sent",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_rejected = Counter(
            "pdserve_router_queue_rejected_total",
            "Requests refused with 429 because the estimated queue wait was above "
            "--max-queue-wait", registry=r,
        )

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

    def render(self) -> bytes:
        """The text exposition format for GET /metrics."""
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self._multiprocess_dir)
        return generate_latest(merged)
