"""`pdserve plan`'s sizing (benchmarks/capacity.py): the pod counts and the
arithmetic it prints, its inputs from a bench result and a router's
/metrics, and the errors bad inputs get."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.capacity import (
    PodCapacity,
    Workload,
    explain,
    prefill_rate_from_router,
    size,
    workload_from_bench,
)
from pdserve.cli import main as pdserve
from router.metrics import RouterMetrics


def test_each_side_is_its_rate_over_one_pod_with_headroom() -> None:
    s = size(Workload(40_000, 6_000), PodCapacity(12_000, 2_500), headroom=0.2)
    assert s.prefill_demand == pytest.approx(48_000)
    assert s.decode_demand == pytest.approx(7_200)
    assert (s.prefill_pods, s.decode_pods) == (4, 3)  # 4.00 stays 4; 2.88 rounds up
    assert s.exact_ratio == pytest.approx((48_000 / 12_000) / (7_200 / 2_500))


def test_cached_prompt_tokens_need_no_prefill_and_a_side_has_at_least_one_pod() -> None:
    s = size(Workload(10_000, 100, prefix_hit_ratio=0.75), PodCapacity(1_000, 5_000),
             headroom=0.0)
    assert s.prefill_demand == pytest.approx(2_500)
    assert (s.prefill_pods, s.decode_pods) == (3, 1)
    idle = size(Workload(0, 0), PodCapacity(1_000, 1_000))
    assert (idle.prefill_pods, idle.decode_pods) == (1, 1)
    assert math.isinf(idle.exact_ratio)
    assert "n/a" in explain(idle)


def test_explain_shows_the_arithmetic() -> None:
    text = explain(size(Workload(40_000, 6_000), PodCapacity(12_000, 2_500)))
    assert text.splitlines() == [
        "prefill: 40,000 prompt tok/s x (1 - 0 cached) x (1 + 0.2 headroom) = 48,000 tok/s "
        "to compute",
        "         / 12,000 tok/s per prefill pod = 4.00 -> 4 prefill pod(s)",
        "decode:  6,000 output tok/s x (1 + 0.2 headroom) = 7,200 tok/s to generate",
        "         / 2,500 tok/s per decode pod = 2.88 -> 3 decode pod(s)",
        "P:D = 4:3 (exact prefill pods per decode pod: 1.39)",
    ]


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Workload(-1, 10), "prompt-tokens-per-s must be a number >= 0, got -1"),
    (lambda: Workload(1, math.nan), "output-tokens-per-s must be a number >= 0"),
    (lambda: Workload(1, 1, prefix_hit_ratio=1.0), r"prefix-hit-ratio must be in \[0, 1\)"),
    (lambda: PodCapacity(0, 1), "prefill-tokens-per-s must be > 0"),
    (lambda: PodCapacity(1, math.inf), "decode-tokens-per-s must be > 0"),
    (lambda: size(Workload(1, 1), PodCapacity(1, 1), headroom=-0.1), "headroom must be"),
])
def test_bad_inputs_name_the_value_and_its_limit(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_workload_from_a_bench_serve_result() -> None:
    w = workload_from_bench({"input_throughput": 337.5, "output_throughput": 84.0,
                             "server_metrics": {"prefix_cache_hit_rate": 0.25}})
    assert (w.prompt_tokens_per_s, w.output_tokens_per_s, w.prefix_hit_ratio) == (
        337.5, 84.0, 0.25)
    # a run whose pods' metrics were not read has no hit rate
    assert workload_from_bench({"input_throughput": 1, "output_throughput": 2,
                                "server_metrics": {"prefix_cache_hit_rate": None}}
                               ).prefix_hit_ratio == 0.0
    with pytest.raises(ValueError, match="no output_throughput"):
        workload_from_bench({"input_throughput": 1})


def test_prefill_rate_from_a_router_page() -> None:
    metrics = RouterMetrics()
    rates = {"10.0.0.1:50051": 900.0, "10.0.0.2:50051": 1100.0, "10.0.0.3:50051": None}
    for pod, rate in rates.items():
        metrics.bind_pod_queue(pod, dispatched=lambda: 0.0, wait=lambda: None,
                               rate=lambda r=rate: r)
    assert prefill_rate_from_router(metrics.render().decode()) == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="has not measured a prefill pod's rate"):
        prefill_rate_from_router(RouterMetrics().render().decode())


def test_the_command_prints_the_plan_or_names_the_bad_flag(tmp_path, capsys) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"input_throughput": 4000, "output_throughput": 600,
                                 "server_metrics": {"prefix_cache_hit_rate": 0.5}}))
    assert pdserve(["plan", "--bench-result", str(bench), "--prefill-tokens-per-s", "1000",
                    "--decode-tokens-per-s", "250", "--headroom", "0"]) == 0
    out = capsys.readouterr().out
    assert "= 2,000 tok/s to compute" in out  # 4000 x (1 - 0.5)
    assert out.rstrip().endswith("P:D = 2:3 (exact prefill pods per decode pod: 0.83)")
    assert pdserve(["plan", "--prompt-tokens-per-s", "1", "--decode-tokens-per-s", "1",
                    "--prefill-tokens-per-s", "1"]) == 2
    assert "needs --prompt-tokens-per-s and --output-tokens-per-s" in capsys.readouterr().err
    assert pdserve(["plan", "--prompt-tokens-per-s", "1", "--output-tokens-per-s", "1",
                    "--decode-tokens-per-s", "1"]) == 2
    assert "one of --prefill-tokens-per-s and --router-metrics" in capsys.readouterr().err
