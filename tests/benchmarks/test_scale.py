"""benchmarks/scale.py's reading of the routing-decision histogram from a
router's /metrics text: per-role counts and interpolated p50/p99."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.scale import bucket_quantile, decision_latency
from router.metrics import RouterMetrics


def test_bucket_quantile_interpolates_within_the_bucket() -> None:
    buckets = [(0.001, 0.0), (0.002, 50.0), (0.004, 100.0), (float("inf"), 100.0)]
    assert bucket_quantile(0.5, buckets) == 0.002
    assert bucket_quantile(0.25, buckets) == 0.0015
    assert bucket_quantile(0.75, buckets) == 0.003
    assert bucket_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    # past the last finite bound: that bound
    assert bucket_quantile(0.99, [(0.1, 1.0), (float("inf"), 10.0)]) == 0.1


def test_decision_latency_reads_a_real_routers_page() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    for seconds in (20e-6, 30e-6, 40e-6, 800e-6):
        metrics.routing_decision["decode"].observe(seconds)
    got = decision_latency(generate_latest(metrics.registry).decode())
    assert got["prefill"] == {"count": 0.0, "p50_us": None, "p99_us": None}
    decode = got["decode"]
    assert decode["count"] == 4.0
    # 20 us is in (10, 25], 30 and 40 in (25, 50], 800 in (500, 1000]
    assert decode["p50_us"] == pytest.approx(37.5)  # rank 2: halfway through (25, 50]
    assert decode["p99_us"] == pytest.approx(980.0)  # rank 3.96 in (500, 1000]
