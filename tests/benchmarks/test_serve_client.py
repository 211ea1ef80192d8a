"""The load client (benchmarks/serve_client.py) against a live `pdserve up`
(router + one colocated pod on the tiny model, real processes on loopback,
started the way `pdserve bench peer` starts it), and its pure parts."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from benchmarks import peer_servers
from benchmarks.serve_client import (
    LoadSpec,
    _answer_ids,
    _with_answer,
    percentile,
    random_prompts,
    run_load,
    run_sessions,
)
from benchmarks.serve_workload import BenchRequest, RandomWorkload, Vocabulary

pytestmark = pytest.mark.timeout(180)

VOCAB = 1100  # within the tiny model's vocabulary (checked below)


@pytest.fixture(scope="module")
def pdserve_server(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(base URL, served model name) of `pdserve up` colocated on the tiny model."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] >= VOCAB
    settings = peer_servers.ServerSettings(vllm_python="", kv_cache_gib=1, max_model_len=512)
    server = peer_servers.start("pdserve", str(tiny_model_dir), "float32", settings,
                                tmp_path_factory.mktemp("peer-logs"))
    try:
        yield server.base_url, server.wait_ready(120)
    finally:
        server.stop()
    assert server.process.returncode is not None


def _assert_stats(stats: dict) -> None:
    assert set(stats) == {"mean", "p50", "p90", "p99"}
    assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"]
    assert stats["mean"] >= 0


def test_load_against_pdserve_counts_every_token(pdserve_server):
    base_url, model = pdserve_server
    prompts = random_prompts(6, 16, VOCAB, seed=3, exclude=frozenset(range(7)))
    result = run_load(base_url, model, prompts, LoadSpec(max_tokens=8, concurrency=2))

    assert result["num_requests"] == result["completed"] == 6
    assert result["errors"] == 0 and result["error_messages"] == []
    assert result["input_tokens"] == 6 * 16 and result["output_tokens"] == 6 * 8
    assert result["duration_s"] > 0
    assert result["output_throughput"] == pytest.approx(48 / result["duration_s"])
    assert result["request_throughput"] == pytest.approx(6 / result["duration_s"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        _assert_stats(result[name])
    assert result["ttft_ms"]["p50"] > 0
    assert result["e2e_ms"]["p50"] >= result["ttft_ms"]["p50"]
    for record in result["requests"]:
        assert record["error"] is None
        assert record["prompt_len"] == 16 and record["output_tokens"] == 8
        assert len(record["itl_s"]) == 8 - 1
        assert 1 <= record["chunks"] <= 8
        assert 0 < record["ttft_s"] <= record["e2e_s"]
        assert all(gap >= 0 for gap in record["itl_s"])
        assert record["ttft_s"] + sum(record["itl_s"]) == pytest.approx(record["e2e_s"],
                                                                       abs=0.05)
    # at most 2 in flight: the third request starts after one of the first two ended
    starts = sorted(r["start_s"] for r in result["requests"])
    first_end = min(r["start_s"] + r["e2e_s"] for r in result["requests"])
    assert starts[2] >= first_end - 1e-3
    json.loads(json.dumps(result, allow_nan=False))  # strict JSON


def test_chunk_counting_takes_tokens_from_usage(pdserve_server):
    base_url, model = pdserve_server
    prompts = random_prompts(3, 16, VOCAB, seed=4, exclude=frozenset(range(7)))
    result = run_load(base_url, model, prompts,
                      LoadSpec(max_tokens=8, concurrency=3, token_count="chunks"))
    assert result["errors"] == 0 and result["output_tokens"] == 3 * 8
    for record in result["requests"]:
        assert record["output_tokens"] == 8
        assert len(record["itl_s"]) == record["chunks"] - 1


def test_poisson_arrivals_follow_the_seeded_schedule(pdserve_server):
    base_url, model = pdserve_server
    prompts = random_prompts(4, 8, VOCAB, seed=5, exclude=frozenset(range(7)))
    result = run_load(base_url, model, prompts,
                      LoadSpec(max_tokens=2, concurrency=4, request_rate=20.0, seed=1))
    assert result["errors"] == 0
    starts = [r["start_s"] for r in result["requests"]]
    assert starts == sorted(starts) and starts[-1] > starts[0]


def test_real_answers_are_the_next_turns_prefix(pdserve_server):
    """With real answers, turn 2 carries the server's answer to turn 1, which
    the pod computed and caches: its cached prefix reaches into the answer,
    where the stand-in's random tokens stop it at the first prompt."""
    base_url, model = pdserve_server
    workload = RandomWorkload(num_sessions=2, input_len=40, output_len=24, turns=2, seed=9)
    sessions = workload.sessions(Vocabulary(VOCAB, frozenset(range(7))))
    cached = {}
    for real in (False, True):
        spec = LoadSpec(max_tokens=1, concurrency=2, real_answers=real)
        result = run_sessions(base_url, model, sessions, spec)
        assert result["errors"] == 0
        seconds = [r for r in result["requests"] if r["turn"] == 1]
        assert [r["prompt_len"] for r in seconds] == [40 + 24 + 40] * 2
        cached[real] = [r["cached_tokens"] for r in seconds]
    # turn 1 has 40 prompt tokens; its 24-token answer fills the pod's next block
    assert all(real > stand_in for real, stand_in in zip(cached[True], cached[False],
                                                         strict=True)), cached
    assert min(cached[True]) >= 48


def test_think_time_separates_a_sessions_turns(pdserve_server):
    base_url, model = pdserve_server
    sessions = RandomWorkload(num_sessions=1, input_len=8, output_len=2, turns=2,
                              seed=10).sessions(Vocabulary(VOCAB, frozenset(range(7))))
    result = run_sessions(base_url, model, sessions,
                          LoadSpec(max_tokens=1, think_s=0.4))
    first, second = result["requests"]
    assert second["start_s"] >= first["start_s"] + first["e2e_s"] + 0.4


def test_with_answer_replaces_the_stand_in():
    turn = BenchRequest((1, 2, 3, 9, 9, 4, 5), 2, "s", answer_at=3)
    assert _with_answer(turn, (1, 2, 3), [7, 8], 2).prompt == (1, 2, 3, 7, 8, 4, 5)
    with pytest.raises(RuntimeError, match="has 2 tokens, but this turn's answer stand-in "
                                           "starts at 3"):
        _with_answer(turn, (1, 2), [7, 8], 2)
    with pytest.raises(RuntimeError, match="need return_tokens_as_token_ids"):
        _answer_ids({"logprobs": {"tokens": ["hello"]}})
    assert _answer_ids({"logprobs": {"tokens": ["token_id:5", "token_id:0"]}}) == [5, 0]


def test_server_errors_are_counted_not_raised(pdserve_server):
    base_url, _ = pdserve_server
    prompts = random_prompts(2, 8, VOCAB, seed=6)
    result = run_load(base_url, "no-such-model", prompts, LoadSpec(max_tokens=2))
    assert result["errors"] == 2 and result["completed"] == 0
    assert result["error_messages"][0].startswith("RuntimeError: HTTP 404")
    assert result["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    json.loads(json.dumps(result, allow_nan=False))


def test_random_prompts_are_seeded_and_avoid_excluded_ids():
    exclude = frozenset({0, 1, 2, 3})
    first = random_prompts(3, 50, 10, seed=7, exclude=exclude)
    assert first == random_prompts(3, 50, 10, seed=7, exclude=exclude)
    assert first != random_prompts(3, 50, 10, seed=8, exclude=exclude)
    assert [len(p) for p in first] == [50, 50, 50]
    assert {t for p in first for t in p} <= set(range(4, 10))
    with pytest.raises(ValueError, match="no token ids left"):
        random_prompts(1, 5, 4, exclude=exclude)


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    with pytest.raises(ValueError):
        percentile([], 50)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": 4, "concurrency": 0}, "concurrency must be >= 1"),
    ({"max_tokens": 4, "request_rate": 0.0}, "request_rate must be > 0"),
    ({"max_tokens": 4, "token_count": "bytes"}, "token_count must be one of"),
    ({"max_tokens": 4, "real_answers": True, "turn_overlap": True}, "real answers need"),
    ({"max_tokens": 4, "think_s": -1.0}, "think_s must be in"),
    ({"max_tokens": 4, "think_s": 1.0, "turn_overlap": True}, "think_s needs each turn"),
    ({"max_tokens": 4, "real_answers": True, "token_count": "chunks"}, "real answers need"),
])
def test_load_spec_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadSpec(**kwargs)
