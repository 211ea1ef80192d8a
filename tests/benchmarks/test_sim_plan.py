"""benchmarks/sim_plan.py: P:D counts checked against the simulator.

The search's steps are checked over a latency table (which counts it tries,
in order, and what it answers); one real `pdserve bench scale --plan-*` run
(a redis-server, a `pdserve sim` process, a router, the workload) checks the
wiring end to end at the smallest search space: the estimate 1:1 meets loose
targets and nothing smaller exists."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.capacity import PodCapacity, Workload, size
from benchmarks.sim_plan import Run, Targets, pod_capacity, search, workload_rates
from sim.perf_model import load_profile

TARGETS = Targets(ttft_p90_ms=150.0, itl_p90_ms=40.0)


def table(prefill: int, decode: int) -> Run:
    """TTFT falls with prefill pods, ITL with decode pods: 3:3 is the smallest that meets."""
    return Run(prefill, decode, ttft_p90_ms=400.0 / prefill, itl_p90_ms=90.0 / decode)


def sizing(prefill_pods: int, decode_pods: int):
    s = size(Workload(100.0 * prefill_pods, 100.0 * decode_pods),
             PodCapacity(120.0, 120.0), headroom=0.0)
    assert (s.prefill_pods, s.decode_pods) == (prefill_pods, decode_pods)
    return s


def counts(plan) -> list[tuple[int, int]]:
    return [(r.prefill, r.decode) for r in plan.runs]


def test_an_estimate_too_small_steps_up_each_side_that_misses_then_tries_smaller() -> None:
    plan = search(sizing(1, 1), table, TARGETS)
    assert counts(plan) == [(1, 1), (2, 2), (3, 3), (2, 3), (3, 2)]
    assert plan.answer == (3, 3)


def test_an_estimate_too_large_steps_down_while_both_targets_hold() -> None:
    plan = search(sizing(4, 4), table, TARGETS)
    assert counts(plan) == [(4, 4), (3, 4), (2, 4), (3, 3), (2, 3), (3, 2)]
    assert plan.answer == (3, 3)


def test_only_one_side_grows_when_only_its_target_is_missed_and_errors_miss_both() -> None:
    def ttft_only(prefill: int, decode: int) -> Run:
        return Run(prefill, decode, ttft_p90_ms=400.0 / prefill, itl_p90_ms=10.0,
                   errors=1 if (prefill, decode) == (2, 1) else 0)

    plan = search(sizing(1, 1), ttft_only, TARGETS)
    # 1:1 misses TTFT alone -> 2:1, whose failed request misses both -> 3:2
    assert counts(plan)[:3] == [(1, 1), (2, 1), (3, 2)]
    assert plan.answer == (3, 1)


def test_the_run_limit_ends_the_search_without_an_answer() -> None:
    plan = search(sizing(1, 1), table, TARGETS, max_runs=2)
    assert counts(plan) == [(1, 1), (2, 2)] and plan.answer is None
    with pytest.raises(ValueError, match="--plan-max-runs must be >= 1"):
        search(sizing(1, 1), table, TARGETS, max_runs=0)
    with pytest.raises(ValueError, match="--plan-itl-ms must be > 0 milliseconds"):
        Targets(100.0, -1.0)


def test_pod_capacity_from_the_profile() -> None:
    perf = load_profile("cpu-base")
    c = pod_capacity(perf, mean_prompt=100, mean_output=20, itl_target_s=0.05)
    assert c.prefill_tokens_per_s == pytest.approx(100 / (0.0074 + 100 * 0.00214))
    per_row = 0.00189 + 110 * 2.08e-6  # context: the prompt and half the output
    batch = 20  # floor((50 ms - 7.4 ms) / 2.12 ms)
    assert c.decode_tokens_per_s == pytest.approx(batch / (0.0074 + batch * per_row))
    roomy = pod_capacity(perf, mean_prompt=100, mean_output=20, itl_target_s=1.0)
    assert roomy.decode_tokens_per_s == pytest.approx(64 / (0.0074 + 64 * per_row))
    with pytest.raises(ValueError, match=r"ITL target 9 ms is below .*\(9.52 ms\)"):
        pod_capacity(perf, mean_prompt=100, mean_output=20, itl_target_s=0.009)


def test_workload_rates_need_arrivals_spread_in_time() -> None:
    w = workload_rates([0.0, 1.0, 2.0], [10, 10, 10], [5, 5, 5])
    assert (w.prompt_tokens_per_s, w.output_tokens_per_s) == (15.0, 7.5)
    with pytest.raises(ValueError, match="--request-rate"):
        workload_rates([0.0, 0.0], [10, 10], [5, 5])


def test_bench_scale_plan_runs_the_simulator_at_the_estimate(tmp_path) -> None:
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "scale", "--plan-ttft-ms", "60000",
         "--plan-itl-ms", "60000", "--num-prompts", "4", "--input-len", "32",
         "--output-len", "4", "--request-rate", "4", "--vocab-from", "tiny",
         "--sim-model", "tiny", "--profile", "cpu-base", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    assert plan["estimate"]["prefill_pods"] == plan["estimate"]["decode_pods"] == 1
    [run] = plan["runs"]  # 1:1 meets; no smaller counts exist
    assert (run["prefill"], run["decode"], run["errors"]) == (1, 1, 0)
    assert 0 < run["ttft_p90_ms"] < 60000 and 0 < run["itl_p90_ms"] < 60000
    assert plan["answer"] == [1, 1]
    assert "P:D = 1:1 meets both targets" in proc.stdout
