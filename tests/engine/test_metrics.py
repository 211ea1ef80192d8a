"""`engine.metrics.PodMetrics`: names fixed by DESIGN.md, role label, per-process registry."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from engine.metrics import PodMetrics

DESIGN_NAMES = (
    "pdserve_time_to_first_token_seconds",
    "pdserve_inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds",
    "pdserve_requests_waiting",
    "pdserve_requests_running",
    "pdserve_kv_blocks_free",
    "pdserve_kv_blocks_total",
    "pdserve_prefix_cache_queries_total",
    "pdserve_prefix_cache_hits_total",
    "pdserve_kv_transfer_bytes_total",
    "pdserve_kv_transfer_seconds",
    "pdserve_kv_landing_bytes_in_use",
    "pdserve_kv_injection_seconds",
)


def test_every_design_metric_is_exported_with_the_role_label():
    metrics = PodMetrics.create("decode")
    metrics.kv_landing_bytes_in_use.set(4096)
    metrics.transfer_failure("deadline")
    metrics.abort("client")
    metrics.abort("client")
    text = generate_latest(metrics.registry).decode()
    sample_names = {line.split("{")[0] for line in text.splitlines() if line[:1] != "#"}
    for name in DESIGN_NAMES:
        assert name in sample_names or f"{name}_bucket" in sample_names, name
    assert 'pdserve_kv_landing_bytes_in_use{role="decode"} 4096.0' in text
    assert 'pdserve_kv_transfer_failures_total{reason="deadline",role="decode"} 1.0' in text
    assert 'pdserve_aborts_total{reason="client",role="decode"} 2.0' in text
    for name in ("pdserve_join_holds_total", "pdserve_join_hold_seconds_total"):
        assert f'{name}{{role="decode"}} 0.0' in text, name


def test_two_pods_in_one_process_do_not_share_registries():
    a = PodMetrics.create("prefill")
    b = PodMetrics.create("prefill")
    a.kv_transfer_bytes.inc(10)
    assert 'pdserve_kv_transfer_bytes_total{role="prefill"} 10.0' in generate_latest(
        a.registry).decode()
    assert 'pdserve_kv_transfer_bytes_total{role="prefill"} 0.0' in generate_latest(
        b.registry).decode()


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role must be one of"):
        PodMetrics.create("router")
