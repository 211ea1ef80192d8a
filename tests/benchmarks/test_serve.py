"""`pdserve bench serve` against a live `pdserve up` (router + one prefill +
one decode pod on the tiny model, real processes on loopback, each pod pinned
to its own CPU where there are two), then `pdserve bench serve-plot` on its
results."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import first_gap, peer_servers, serve, serve_plot
from pdserve.commands._cpus import allowed_cpus

pytestmark = pytest.mark.timeout(240)

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / \
    "synthetic_trace.jsonl"
STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
FIELDS = {
    "label", "base_url", "model", "workload", "load", "machine", "started_unix",
    "num_requests", "completed", "errors", "error_messages", "duration_s", "input_tokens",
    "output_tokens", "request_throughput", "input_throughput", "output_throughput",
    "total_token_throughput", *STATS, "goodput", "server_metrics", "requests",
}
METRICS = {"urls", "note", "prefix_cache_queries", "prefix_cache_hits", "kv_bytes_sent",
           "kv_bytes_received", "kv_bytes_saved", "prefix_cache_hit_rate"}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """(base URL, `pdserve up --ready-file`) of a disaggregated stack."""
    logs = tmp_path_factory.mktemp("serve-bench")
    ready = logs / "up.json"
    cpus = allowed_cpus()
    pin = ["--prefill-cpus", str(cpus[0]), "--decode-cpus", str(cpus[-1])]
    server = peer_servers.start_up(
        "pdserve-up", str(tiny_model_dir),
        [*pin, "--ready-file", str(ready), "--pod-arg=--kv-cache-memory=256MiB"],
        logs / "up.log")
    try:
        server.wait_ready(120)
        server.wait_file(ready, 30)
        yield server.base_url, ready
    finally:
        server.stop()


def _bench(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def _check_result(result: dict, num_requests: int) -> None:
    """Every field present, counts adding up, percentiles ordered, no errors."""
    assert set(result) == FIELDS
    # the load's own lengths and arrivals are in "workload", not placeholders here
    assert set(result["load"]) == {"concurrency", "token_count", "timeout_s"}
    assert result["load"]["concurrency"] >= 1
    assert result["num_requests"] == result["completed"] == num_requests
    assert result["errors"] == 0 and result["error_messages"] == []
    assert len(result["requests"]) == num_requests
    assert result["input_tokens"] == sum(r["prompt_len"] for r in result["requests"])
    assert result["output_tokens"] == sum(r["max_tokens"] for r in result["requests"])
    for name in ("request_throughput", "input_throughput", "output_throughput",
                 "total_token_throughput"):
        assert result[name] > 0
    assert result["output_throughput"] == pytest.approx(
        result["output_tokens"] / result["duration_s"])
    for name in STATS:
        stats = result[name]
        assert set(stats) == {"mean", "p50", "p90", "p99"}
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    assert 0 < result["ttft_ms"]["p50"] <= result["e2e_ms"]["p50"]
    metrics = result["server_metrics"]
    assert set(metrics) == METRICS and metrics["note"] is None and len(metrics["urls"]) == 2
    # one prefill and one decode pod: every byte sent was received
    assert metrics["kv_bytes_sent"] == metrics["kv_bytes_received"] > 0
    assert 0 <= metrics["prefix_cache_hits"] <= metrics["prefix_cache_queries"]
    json.loads(json.dumps(result, allow_nan=False))  # strict JSON


def test_multi_turn_load_reports_every_field(stack, tmp_path, capsys):
    base_url, ready = stack
    up = json.loads(ready.read_text())
    assert [(p["role"], p["cpus"]) for p in up["pods"]] == [
        ("prefill", str(allowed_cpus()[0])), ("decode", str(allowed_cpus()[-1]))]
    out = tmp_path / "multi.json"
    args = _bench(["--base-url", base_url, "--vocab-from", "tiny", "--num-prompts", "3",
                   "--turns", "2", "--input-len", "40", "--output-len", "6",
                   "--range-ratio", "0.2", "--request-rate", "20", "--concurrency", "4",
                   "--warmup", "1", "--slo-ttft", "60000", "--up-ready-file", str(ready),
                   "--label", "disaggregated", "--out", str(out), "--no-progress"])
    assert serve.main(args) == 0
    result = json.loads(out.read_text())
    _check_result(result, 6)
    assert result["model"] == "tiny" and result["label"] == "disaggregated"
    assert result["goodput"]["requests"] == 6 and result["goodput"]["fraction"] == 1.0
    by_session: dict[str, list[dict]] = {}
    for record in result["requests"]:
        by_session.setdefault(record["session_id"], []).append(record)
    assert len(by_session) == 3 and all(len(turns) == 2 for turns in by_session.values())
    for first, second in by_session.values():
        # turn 2 starts after turn 1 ended, and its prompt holds turn 1's
        assert second["start_s"] >= first["start_s"] + first["e2e_s"] - 1e-3
        assert second["prompt_len"] > first["prompt_len"]
    # the second turns re-send the first turns' prompts: the prefix cache hits
    assert result["server_metrics"]["prefix_cache_hit_rate"] > 0
    assert "disaggregated: 6/6 requests" in capsys.readouterr().out


def test_trace_replay_reports_every_field(stack, tmp_path):
    base_url, ready = stack
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 0, "input_length": 70, "output_length": 40, "hash_ids": [0, 1, 2]},
             {"timestamp": 100, "input_length": 80, "output_length": 20,
              "hash_ids": [0, 1, 3]},
             {"timestamp": 300, "input_length": 10, "output_length": 60, "hash_ids": [4]}]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "trace.json"
    argv = ["--base-url", base_url, "--vocab-from", "tiny", "--trace", str(trace),
            "--trace-block-size", "64", "--length-scale", "0.5", "--output-scale", "0.1",
            "--time-scale", "2", "--metrics-url", json.loads(ready.read_text())["pods"][0]
            ["metrics"], "--metrics-url", json.loads(ready.read_text())["pods"][1]["metrics"],
            "--label", "trace", "--out", str(out), "--plot-dir", str(tmp_path / "plots"),
            "--no-progress"]
    assert serve.main(_bench(argv)) == 0
    result = json.loads(out.read_text())
    _check_result(result, 3)
    assert [r["prompt_len"] for r in result["requests"]] == [35, 40, 5]
    assert [r["max_tokens"] for r in result["requests"]] == [4, 2, 6]
    starts = [r["start_s"] for r in result["requests"]]
    assert starts[1] - starts[0] == pytest.approx(0.2, abs=0.1)
    assert starts[2] - starts[0] == pytest.approx(0.6, abs=0.1)
    # the second line shares two 32-token blocks with the first
    assert result["server_metrics"]["prefix_cache_hits"] >= 2
    for name in ("ttft_cdf.png", "itl_cdf.png", "e2e_cdf.png", "throughput.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason="the shared synthetic trace is absent")
def test_a_few_lines_of_the_synthetic_trace(stack, tmp_path):
    base_url, ready = stack
    out = tmp_path / "synthetic.json"
    argv = ["--base-url", base_url, "--vocab-from", "tiny", "--trace", str(SHARED_TRACE),
            "--max-requests", "4", "--length-scale", str(1 / 256), "--output-scale", "0.02",
            "--time-scale", "0.5", "--up-ready-file", str(ready), "--out", str(out),
            "--no-progress"]
    assert serve.main(_bench(argv)) == 0
    result = json.loads(out.read_text())
    _check_result(result, 4)
    assert result["workload"]["kind"] == "trace" and result["workload"]["block_size"] == 512


def test_serve_plot_overlays_runs(tmp_path, capsys):
    def run(label: str, scale: float) -> dict:
        records = [{"error": None, "start_s": 0.1 * i, "ttft_s": 0.05 * scale,
                    "e2e_s": 0.2 * scale, "output_tokens": 4, "itl_s": [0.05 * scale] * 3}
                   for i in range(5)]
        return {"label": label, "duration_s": 1.0, "requests": records}

    paths = []
    for label, scale in (("a", 1.0), ("b", 2.0)):
        paths.append(tmp_path / f"{label}.json")
        paths[-1].write_text(json.dumps(run(label, scale)))
    xs, ys = serve_plot.throughput_series(run("a", 1.0), 0.25)
    assert sum(y * 0.25 for y in ys) == 20 and len(xs) == len(ys) == 5
    parser = argparse.ArgumentParser()
    serve_plot.add_arguments(parser)
    args = parser.parse_args([*map(str, paths), "--out", str(tmp_path / "charts")])
    assert serve_plot.main(args) == 0
    assert len(capsys.readouterr().out.split()) == 4
    assert (tmp_path / "charts" / "ttft_cdf.png").stat().st_size > 1000
    (tmp_path / "bad.json").write_text("{}")
    args = parser.parse_args([str(tmp_path / "bad.json"), "--out", str(tmp_path)])
    assert serve_plot.main(args) == 2


def test_bad_flags_are_refused_by_name(capsys):
    assert serve.main(_bench(["--concurrency", "0", "--model", "m"])) == 2
    assert "error: --concurrency must be >= 1, got 0" in capsys.readouterr().err
    assert serve.main(_bench(["--trace", os.devnull, "--request-rate", "1",
                              "--model", "m"])) == 2
    assert "--request-rate and --trace exclude each other" in capsys.readouterr().err
    assert serve.main(_bench(["--slo-itl", "0", "--model", "m", "--vocab-from", "tiny"])) == 2
    assert "--slo-itl must be > 0 ms" in capsys.readouterr().err


def test_first_gap_against_the_live_stack(stack, capsys):
    base_url, _ = stack
    parser = argparse.ArgumentParser()
    first_gap.add_arguments(parser)
    args = parser.parse_args(["--url", base_url, "--requests", "2", "--prompt-len", "32",
                              "--max-tokens", "5", "--seed", "77"])
    assert first_gap.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests"] == 2
    assert 0 < result["gap_ms_p50"] <= result["gap_ms_max"]
    assert result["itl_ms_p50"] > 0 and result["gap_over_itl_p50"] > 0
