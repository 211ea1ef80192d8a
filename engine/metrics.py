"""Prometheus metrics of a pod (prefill, decode or colocated).

Who uses it: each pod's `main` builds one `PodMetrics` with its own
`CollectorRegistry` (no process-global registry, so tests can build several
pods in one process) and hands it to the engine loop and the servicers,
which update it from whichever thread observes the event (prometheus_client
metric objects are thread-safe). The pod serves `registry` on
`--metrics-port` with `serve_metrics`.

Names are fixed by DESIGN.md ("Metrics"): dashboards and autoscalers key on
them. Every metric carries a `role` label ("prefill" | "decode" |
"colocated"), because the router and all pod roles export the same names;
the metric objects below are the children already bound to this pod's role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from engine.token_gauges import TokenGauges
from proto.roles import PodRole

# Latency buckets from 1 ms to ~80 s: TTFT on a CPU pod with a long prompt is
# seconds, inter-token latency on a GPU is milliseconds.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """The metric objects of one pod, already bound to its `role` label.

    Failure and abort counters stay labelled by `reason` so callers pick the
    child with `.labels(role=..., reason=...)` through `transfer_failure(reason)`
    / `abort(reason)`.
    """

    registry: CollectorRegistry
    role: str
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    requests_waiting: Gauge
    requests_running: Gauge
    kv_blocks_free: Gauge
    requests_reserved: Gauge
    kv_blocks_reserved: Gauge
    kv_blocks_total: Gauge
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prefix_waits: Counter
    kv_transfer_bytes: Counter
    kv_transfer_saved_bytes: Counter
    kv_transfer_seconds: Histogram
    kv_landing_bytes_in_use: Gauge
    kv_injection_seconds: Histogram
    join_holds: Counter
    join_hold_seconds: Counter
    itl_budget_capped_steps: Counter
    tokens: TokenGauges
    _kv_transfer_failures: Counter
    _aborts: Counter
    _step_model: Gauge

    def __post_init__(self) -> None:
        PodRole.parse(self.role)

    @classmethod
    def create(cls, role: str, registry: CollectorRegistry | None = None) -> PodMetrics:
        """Register every pod metric in `registry` (a fresh one when None)."""
        PodRole.parse(role)
        reg = CollectorRegistry(auto_describe=True) if registry is None else registry
        lbl = ("role",)

        def hist(name: str, doc: str) -> Histogram:
            metric = Histogram(name, doc, lbl, registry=reg, buckets=_LATENCY_BUCKETS)
            return metric.labels(role=role)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lbl, registry=reg).labels(role=role)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lbl, registry=reg).labels(role=role)

        return cls(
            registry=reg,
            role=role,
            time_to_first_token=hist(
                "pdserve_time_to_first_token_seconds",
                "Request arrival at this pod until its first output token is known.",
            ),
            inter_token_latency=hist(
                "pdserve_inter_token_latency_seconds", "Gap between consecutive output tokens."
            ),
            e2e_request_latency=hist(
                "pdserve_e2e_request_latency_seconds", "Request arrival until it finished."
            ),
            requests_waiting=gauge("pdserve_requests_waiting", "Requests queued in the engine."),
            requests_running=gauge(
                "pdserve_requests_running", "Sequences in the engine's running batch."
            ),
            kv_blocks_free=gauge("pdserve_kv_blocks_free", "Free KV cache blocks."),
            requests_reserved=gauge(
                "pdserve_requests_reserved",
                "Decode pod: requests holding a reservation, waiting for their remote KV.",
            ),
            kv_blocks_reserved=gauge(
                "pdserve_kv_blocks_reserved", "Decode pod: KV blocks held by reserved requests."
            ),
            kv_blocks_total=gauge("pdserve_kv_blocks_total", "KV cache blocks in total."),
            prefix_cache_queries=counter(
                "pdserve_prefix_cache_queries_total", "Prompt blocks looked up in the prefix cache."
            ),
            prefix_cache_hits=counter(
                "pdserve_prefix_cache_hits_total", "Prompt blocks found in the prefix cache."
            ),
            prefix_waits=counter(
                "pdserve_prefix_waits_total",
                "Requests that waited for prompt blocks another request was computing "
                "(engine/prefix_wait.py) instead of computing them twice.",
            ),
            kv_transfer_bytes=counter(
                "pdserve_kv_transfer_bytes_total", "KV bytes sent (prefill) or received (decode)."
            ),
            kv_transfer_saved_bytes=counter(
                "pdserve_kv_transfer_saved_bytes_total",
                "KV bytes a decode pod did not receive because its prefix cache held "
                "them (cache-miss-only transfer).",
            ),
            kv_transfer_seconds=hist(
                "pdserve_kv_transfer_seconds", "One request's KV transfer, BEGIN to END."
            ),
            kv_landing_bytes_in_use=gauge(
                "pdserve_kv_landing_bytes_in_use", "Bytes of landing buffers held by transfers."
            ),
            kv_injection_seconds=hist(
                "pdserve_kv_injection_seconds", "Time to inject one request's KV into the cache."
            ),
            join_holds=counter(
                "pdserve_join_holds_total",
                "Decode pod: steps whose start waited for a transfer about to complete "
                "(--join-wait).",
            ),
            join_hold_seconds=counter(
                "pdserve_join_hold_seconds_total",
                "Decode pod: time steps' starts waited for transfers about to complete.",
            ),
            itl_budget_capped_steps=counter(
                "pdserve_itl_budget_capped_steps_total",
                "Steps whose prompt tokens the inter-token budget cut (--itl-budget-ms).",
            ),
            tokens=TokenGauges(
                prompt_tokens_waiting=gauge(
                    "pdserve_prompt_tokens_waiting",
                    "Prompt tokens the engine has still to compute, less the cached prefix: "
                    "waiting requests and running ones part-way through their prompt.",
                ),
                running_context_tokens=gauge(
                    "pdserve_running_context_tokens",
                    "Context tokens (prompt and output) of the running sequences.",
                ),
                kv_cache_usage=gauge(
                    "pdserve_kv_cache_usage_ratio",
                    "KV cache blocks in use (held by requests, reservations included) over "
                    "all blocks, 0 to 1.",
                ),
                queue_wait=hist(
                    "pdserve_queue_wait_seconds",
                    "Time a request waited in the engine's queue before its first step.",
                ),
                queue_wait_p50=gauge(
                    "pdserve_queue_wait_p50_seconds",
                    "Median queue wait of the requests first scheduled in the last 60 s; "
                    "NaN when there were none.",
                ),
            ),
            _step_model=Gauge(
                "pdserve_step_time_model_seconds",
                "The pod's learnt step-time model (--itl-budget-ms): seconds per step, per "
                "row, per computed token and per 1000 attended context tokens (term); 0 "
                "until it has seen steps with and without prompt tokens.",
                ("role", "term"), registry=reg,
            ),
            _kv_transfer_failures=Counter(
                "pdserve_kv_transfer_failures_total",
                "KV transfers that ended without END, by reason.",
                ("role", "reason"),
                registry=reg,
            ),
            _aborts=Counter(
                "pdserve_aborts_total", "Requests aborted, by reason.", ("role", "reason"),
                registry=reg,
            ),
        )

    def transfer_failure(self, reason: str) -> None:
        """Count one failed transfer; `reason` is a short stable word
        ("timeout", "aborted", "checksum", ...), never a free-form message,
        so the label's cardinality stays bounded."""
        self._kv_transfer_failures.labels(role=self.role, reason=reason).inc()

    def step_model(self, coefficients: dict[str, float]) -> None:
        """Export the ITL budget's step-time model (engine/itl_budget.py)."""
        for term, value in coefficients.items():
            self._step_model.labels(role=self.role, term=term).set(value)

    def publish_tokens(self, engine: Any, stats: Any) -> None:
        """Refresh the token gauges (engine/token_gauges.py) from the engine
        loop thread, after a step or a command."""
        self.tokens.publish(engine, stats)

    def abort(self, reason: str) -> None:
        """Count one aborted request ("client", "deadline", "transfer", "shutdown")."""
        self._aborts.labels(role=self.role, reason=reason).inc()


def serve_metrics(metrics: PodMetrics, host: str, port: int) -> int:
    """Serve `metrics.registry` over HTTP in a daemon thread; returns the
    bound port (`port=0` picks a free one). Called once by the pod's main."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return int(server.server_address[1])
