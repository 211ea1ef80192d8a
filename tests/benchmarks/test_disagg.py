"""`pdserve bench disagg`: the topologies' command lines, the workloads, the
ratio table, flag checks, and one short run of one topology on the tiny model
(the full comparison is a benchmark, not a test)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import disagg
from benchmarks.serve_workload import Vocabulary

pytestmark = pytest.mark.timeout(180)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    disagg.add_arguments(parser)
    return parser.parse_args(argv)


def test_both_topologies_get_the_same_cpus():
    assert disagg.topology_args("disaggregated", (0,), (1,), None) == [
        "--prefill", "1", "--decode", "1", "--prefill-cpus", "0", "--decode-cpus", "1"]
    assert disagg.topology_args("colocated", (0,), (1,), (0, 1)) == [
        "--prefill", "0", "--decode", "0", "--colocated", "1", "--colocated-cpus", "0-1",
        "--router-cpus", "0-1"]
    assert disagg.topology_args("colocated-dp", (0,), (1,), None) == [
        "--prefill", "0", "--decode", "0", "--colocated", "2", "--colocated-cpus", "0/1"]
    # the same pods sharing every CPU (`pdserve up` without pinning)
    assert disagg.topology_args("disaggregated-shared", (0,), (1,), None) == [
        "--prefill", "1", "--decode", "1", "--pin", "off"]


def test_workloads_have_the_issue_shapes(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 1024,
                                         "output_length": 40, "hash_ids": [0, 1]}) + "\n"
                             for i in range(5)))
    args = _args(["--num-requests", "50", "--light-requests", "8", "--trace", str(trace),
                  "--trace-requests", "3"])
    assert disagg._names("heavy-0.8,light-c8", disagg.WORKLOADS, "--workloads") == (
        "heavy-0.8", "light-c8")
    heavy, light, scaled = disagg.build_workloads(("heavy-0.4", "light-c8", "trace"), args,
                                                  Vocabulary(1000))
    prompts = [s.turns[0] for s in heavy.sessions]
    assert len(prompts) == 50 and heavy.concurrency is None
    assert all(384 <= len(t.prompt) <= 1152 and t.max_tokens == 128 for t in prompts)
    gaps = heavy.sessions[-1].arrival_s / 49
    assert 1.5 < gaps < 4.0  # Poisson at 0.4 req/s: mean gap 2.5 s
    assert light.concurrency == 8 and len(light.sessions) == 8
    assert all(len(s.turns[0].prompt) == 256 and s.turns[0].max_tokens == 64
               for s in light.sessions)
    # lengths / 32, outputs / 4, time x 32
    assert [(len(s.turns[0].prompt), s.turns[0].max_tokens, s.arrival_s)
            for s in scaled.sessions] == [(32, 10, 0.0), (32, 10, 32.0), (32, 10, 64.0)]


def test_ratios_are_disaggregated_over_colocated():
    def result(ttft: float, itl: float, tok_s: float, good: float) -> dict:
        return {"ttft_ms": {"p50": ttft}, "itl_ms": {"p99": itl}, "output_throughput": tok_s,
                "goodput": {"request_rate": good}}

    results = {"heavy-0.2": {"disaggregated": result(300, 100, 30, 0.2),
                             "colocated": result(200, 400, 30, 0.1)},
               "light-c8": {"colocated": result(1, 1, 1, 1)}}
    assert disagg.ratios(results) == {"heavy-0.2": {
        "TTFT p50": 1.5, "ITL p99": 0.25, "output tok/s": 1.0, "goodput req/s": 2.0}}
    results["heavy-0.2"]["colocated-dp"] = result(600, 200, 60, 0.4)
    assert disagg.ratios(results, "colocated-dp") == {"heavy-0.2": {
        "TTFT p50": 0.5, "ITL p99": 0.5, "output tok/s": 0.5, "goodput req/s": 0.5}}
    results["heavy-0.2"]["disaggregated-shared"] = result(400, 800, 15, 0.1)
    assert disagg.ratios(results, "colocated", "disaggregated-shared") == {"heavy-0.2": {
        "TTFT p50": 2.0, "ITL p99": 2.0, "output tok/s": 0.5, "goodput req/s": 1.0}}
    assert disagg.target("heavy-0.4", "ITL p99") == "<= 0.3"
    assert disagg.target("light-c8", "ITL p99") == "<= 1.5"  # issue 42
    assert disagg.target("trace", "ITL p99") == ""


@pytest.mark.parametrize("argv, message", [
    (["--prefill-cpus", "0", "--decode-cpus", "0"], "overlap; the comparison needs disjoint"),
    (["--workloads", "heavy-x"], "--workloads: 'heavy-x' is not one of"),
    (["--workloads", "heavy-0"], "--workloads: 'heavy-0' is not one of"),
    (["--topologies", ""], "--topologies needs at least one entry"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--prefill-cpus", "9999"], "CPU list '9999': CPU 9999 is not available"),
])
def test_bad_flags_are_refused_by_name(argv, message, capsys):
    assert disagg.main(_args(argv)) == 2
    assert message in capsys.readouterr().err


def test_one_topology_on_the_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = _args(["--model", str(tiny_model_dir), "--topologies", "colocated",
                  "--workloads", "light-c8", "--light-requests", "2", "--out-dir", str(out),
                  "--pod-arg=--kv-cache-memory=256MiB", "--no-progress"])
    assert disagg.main(args) == 0
    result = json.loads((out / "light-c8-colocated.json").read_text())
    assert result["completed"] == 2 and result["errors"] == 0
    assert result["topology"] == "colocated" and "--colocated-cpus" in result["up_command"]
    assert result["server_metrics"]["kv_bytes_sent"] == 0  # nothing to transfer
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["runs"] == {"light-c8": {"colocated": "light-c8-colocated.json"}}
    assert comparison["ratios"] == {}  # one topology: nothing to compare
    assert (out / "plots" / "light-c8" / "itl_cdf.png").is_file()
    assert "| light-c8 | output tok/s |" in capsys.readouterr().out
    assert Path(out / "up-colocated.json").is_file()
