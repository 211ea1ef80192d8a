"""`pdserve bench routing`: the trace's oracle and conversations, the figures
of one run, flag checks, and one short run on a live stack (the tiny model,
2 prefill pods, cache-aware, a few trace lines sharing prefixes; the full
comparison is a benchmark, not a test)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import routing
from benchmarks.routing_trace import (
    conversation_ids,
    oracle_hit_ratio,
    reachable_hit_ratio,
    with_sessions,
)
from benchmarks.serve_trace import TraceRequest, TraceScaling, trace_sessions
from benchmarks.serve_workload import Vocabulary

pytestmark = pytest.mark.timeout(240)

LINES = [  # (timestamp ms, input length, hash ids): 512-token blocks
    (0, 1500, (0, 1, 2)),
    (1000, 2000, (0, 1, 2, 3)),  # the same conversation, one turn later
    (2000, 1024, (0, 5)),  # shares block 0 only (a system prompt): a new conversation
    (3000, 600, (7, 8)),
]


def requests() -> list[TraceRequest]:
    return [TraceRequest(t, n, 8, ids) for t, n, ids in LINES]


def test_oracle_counts_tokens_of_blocks_seen_before():
    # unscaled: line 1 hits blocks 0-2 (1536), line 2 hits block 0 (512)
    assert oracle_hit_ratio(requests(), TraceScaling()) == pytest.approx(
        (1536 + 512) / (1500 + 2000 + 1024 + 600))
    # scaled 1/32: 16-token blocks, the same shares
    scaled = TraceScaling(512, 1 / 32)
    lengths = [scaled.input_length(r) for r in requests()]
    assert lengths == [47, 62, 32, 19]
    assert oracle_hit_ratio(requests(), scaled) == pytest.approx((48 + 16) / sum(lengths))
    # as the engine caches: line 0 leaves 2 full blocks (47 tokens), line 1 reuses
    # them (its third block was partial in line 0), line 2 reuses block 0
    assert reachable_hit_ratio(requests(), scaled) == pytest.approx((32 + 16) / sum(lengths))


def test_conversations_continue_an_earlier_lines_full_blocks():
    ids = conversation_ids(requests())
    assert ids == ["conversation-0", "conversation-0", "conversation-2", "conversation-3"]
    sessions = with_sessions(trace_sessions(requests(), TraceScaling(512, 1 / 32),
                                            Vocabulary(1000)), ids)
    assert [s.turns[0].session_id for s in sessions] == ids
    with pytest.raises(ValueError, match="3 conversation ids for 4 sessions"):
        with_sessions(sessions, ids[:3])


def test_figures_of_one_run():
    result = {"requests": [{"error": None, "prompt_len": 100, "cached_tokens": 64},
                           {"error": None, "prompt_len": 100, "cached_tokens": 0},
                           {"error": "x", "prompt_len": 50, "cached_tokens": 0}],
              "server_metrics": {"kv_bytes_sent": 1000.0}, "errors": 1,
              "ttft_ms": {"p50": 10.0, "p90": 20.0}}
    row = routing.figures(result, oracle=0.4, bytes_per_token=10)
    assert (row["hit_ratio"], row["hit_vs_oracle"], row["kv_sent_vs_full"]) == pytest.approx(
        (0.32, 0.8, 0.5))
    assert row["decode_kv_hit_fraction"] is None  # no decode counters in this report
    rows = {2: {"round-robin": dict(row, ttft_p90_ms=60.0), "cache-aware": row}}
    routing.add_ttft_gains(rows)
    assert rows[2]["cache-aware"]["ttft_p90_gain_vs_round_robin"] == 3.0


def test_decode_hit_fraction_is_what_the_decode_pods_held_of_what_they_needed():
    result = {"requests": [{"error": None, "prompt_len": 100, "cached_tokens": 50}],
              "server_metrics": {"kv_bytes_sent": 400.0, "kv_bytes_received": 400.0,
                                 "kv_bytes_saved": 600.0},
              "errors": 0, "ttft_ms": {"p50": 10.0, "p90": 20.0}}
    row = routing.figures(result, oracle=0.5, bytes_per_token=10)
    assert row["decode_kv_hit_fraction"] == pytest.approx(0.6)
    assert row["kv_saved_vs_full"] == pytest.approx(0.6)


def test_miss_only_runs_cache_aware_with_the_decode_prefix_cache(
        tiny_model_dir, tmp_path, monkeypatch, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n,
                                         "output_length": 8, "hash_ids": list(ids)}) + "\n"
                             for t, n, ids in LINES))
    seen = {}

    def fake_run(name, up_args, model_dir, workloads, args, out_dir):
        seen[name] = up_args
        ok = {"error": None, "prompt_len": 10, "cached_tokens": 0}
        return {"trace": {"requests": [ok], "errors": 0, "ttft_ms": {"p50": 1.0, "p90": 2.0},
                          "server_metrics": {"kv_bytes_sent": 1.0, "kv_bytes_received": 1.0,
                                             "kv_bytes_saved": 0.0}}}

    monkeypatch.setattr(routing.disagg, "run_topology", fake_run)
    args = _args(["--model", str(tiny_model_dir), "--prefill-counts", "2", "--policies",
                  "cache-aware,cache-aware+miss-only,cache-aware@0.25", "--trace", str(trace),
                  "--trace-start", "0", "--out-dir", str(tmp_path / "out")])
    assert routing.main(args) == 0
    plain, miss_only = seen["prefill2-cache-aware"], seen["prefill2-cache-aware+miss-only"]
    weighted = seen["prefill2-cache-aware@0.25"]
    assert "--router-arg=--routing-policy=cache-aware" in weighted
    assert "--router-arg=--cache-aware-load-weight=0.25" in weighted
    assert not any("load-weight" in arg for arg in plain + miss_only)
    assert "--router-arg=--routing-policy=cache-aware" in plain and "--router-arg=" \
        "--routing-policy=cache-aware" in miss_only
    assert "--decode-arg=--prefix-cache" in miss_only
    assert "--decode-arg=--prefix-cache" not in plain
    assert "| 2 | cache-aware+miss-only |" in capsys.readouterr().out


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    routing.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["--prefill-counts", "0"], "--prefill-counts must be in [1, 64]"),
    (["--prefill-counts", "two"], "--prefill-counts: invalid literal"),
    (["--policies", "random"], "--policies: 'random' is not one of round-robin"),
    (["--policies", ","], "--policies needs at least one entry"),
    (["--policies", "round-robin@0.5"], "--policies: 'round-robin@0.5' is not one of"),
    (["--policies", "cache-aware@-1"], "cache-aware load weight must be in [0, 100]"),
    (["--policies", "cache-aware@x"], "--policies: 'cache-aware@x': could not convert"),
])
def test_bad_flags_are_refused_by_name(argv, message, capsys):
    assert routing.main(_args(argv)) == 2
    assert message in capsys.readouterr().err


def test_a_start_past_the_trace_is_refused(tiny_model_dir, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}))
    assert routing.main(_args(["--model", str(tiny_model_dir), "--trace", str(trace),
                               "--trace-start", "5"])) == 2
    assert "--trace-start 5: the trace has fewer lines" in capsys.readouterr().err


@pytest.mark.slow
def test_a_few_trace_lines_on_a_live_stack(tiny_model_dir, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n,
                                         "output_length": 8, "hash_ids": list(ids)}) + "\n"
                             for t, n, ids in LINES))
    out = tmp_path / "out"
    args = _args(["--model", str(tiny_model_dir), "--prefill-counts", "2",
                  "--policies", "cache-aware", "--trace", str(trace), "--trace-start", "0",
                  "--pod-arg=--kv-cache-memory=64MiB", "--out-dir", str(out),
                  "--no-progress"])
    assert routing.main(args) == 0
    comparison = json.loads((out / "comparison.json").read_text())
    row = comparison["rows"]["2"]["cache-aware"]
    assert row["errors"] == 0 and row["prompt_tokens"] == 47 + 62 + 32 + 19
    # routed to the pod holding them, line 1 reuses the 2 full blocks line 0's 47 tokens
    # left, and line 2 (32 tokens: one reusable block) the first
    assert row["cached_tokens"] == 32 + 16
    assert row["oracle_hit_ratio"] == pytest.approx(64 / 160)
    assert row["reachable_hit_ratio"] == pytest.approx(48 / 160)
    assert row["kv_sent_vs_full"] == pytest.approx(1.0)  # every request sends its whole KV
    assert (out / "trace-prefill2-cache-aware.json").is_file()
    assert "| 2 | cache-aware |" in capsys.readouterr().out
