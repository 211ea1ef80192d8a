"""benchmarks/serve_workload.py and benchmarks/serve_trace.py: what `pdserve
bench serve` sends (pure, seeded; no server)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks.serve_trace import (
    TraceRequest,
    TraceScaling,
    load_trace,
    trace_sessions,
)
from benchmarks.serve_workload import (
    BenchRequest,
    RandomWorkload,
    Vocabulary,
    poisson_arrivals,
    random_lengths,
)

VOCAB = Vocabulary(1000, frozenset(range(10)))
SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / \
    "synthetic_trace.jsonl"


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    first = poisson_arrivals(2000, 4.0, seed=3)
    assert first == poisson_arrivals(2000, 4.0, seed=3)
    assert first != poisson_arrivals(2000, 4.0, seed=4)
    assert first[0] == 0.0 and first == sorted(first)
    mean_gap = first[-1] / (len(first) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals(3, None, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="--request-rate must be > 0"):
        poisson_arrivals(3, 0.0, seed=0)


def test_random_lengths_stay_in_the_range():
    lengths = random_lengths(500, 768, 0.5, random.Random(0))
    assert min(lengths) >= 384 and max(lengths) <= 1152
    assert min(lengths) < 450 and max(lengths) > 1080  # the whole range is used
    assert random_lengths(4, 7, 0.0, random.Random(1)) == [7, 7, 7, 7]
    with pytest.raises(ValueError, match="--range-ratio must be in"):
        random_lengths(1, 8, 1.0, random.Random(0))


def test_random_workload_is_seeded_and_avoids_special_tokens():
    workload = RandomWorkload(num_sessions=5, input_len=40, output_len=6, range_ratio=0.25,
                              request_rate=2.0, seed=9)
    sessions = workload.sessions(VOCAB)
    assert sessions == workload.sessions(VOCAB)
    assert [s.arrival_s for s in sessions] == poisson_arrivals(5, 2.0, 9)
    for session in sessions:
        (turn,) = session.turns
        assert 30 <= len(turn.prompt) <= 50 and 4 <= turn.max_tokens <= 8
        assert turn.session_id is None
        assert all(10 <= t < 1000 for t in turn.prompt)


def test_each_turn_extends_the_previous_prompt_and_answer():
    sessions = RandomWorkload(num_sessions=2, input_len=12, output_len=5, turns=3,
                              seed=1).sessions(VOCAB)
    assert len({s.turns[0].session_id for s in sessions}) == 2
    for session in sessions:
        first, second, third = session.turns
        assert first.session_id == second.session_id == third.session_id is not None
        # prompt k+1 = prompt k + the answer's stand-in (max_tokens of k) + 12 new tokens
        assert second.prompt[:12] == first.prompt
        assert len(second.prompt) == 12 + 5 + 12
        assert third.prompt[:len(second.prompt)] == second.prompt
        assert len(third.prompt) == len(second.prompt) + 5 + 12


def test_bad_workloads_are_refused_by_name():
    with pytest.raises(ValueError, match="--turns must be >= 1"):
        RandomWorkload(num_sessions=1, input_len=4, output_len=4, turns=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        BenchRequest((1, 2), 0)
    with pytest.raises(ValueError, match="no token ids left"):
        Vocabulary(3, frozenset({0, 1, 2})).allowed()


def _trace(tmp_path: Path, lines: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_equal_hash_ids_are_equal_prefixes(tmp_path):
    path = _trace(tmp_path, [
        {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 35, "output_length": 4, "hash_ids": [0, 1, 7]},
        {"timestamp": 1500, "input_length": 9, "output_length": 2, "hash_ids": [1]},
        {"timestamp": 2000, "input_length": 5, "output_length": 2, "hash_ids": []},
    ])
    requests = load_trace(path)
    sessions = trace_sessions(requests, TraceScaling(block_size=16), VOCAB, seed=2)
    a, b, c, d = (s.turns[0] for s in sessions)
    assert [len(x.prompt) for x in (a, b, c, d)] == [40, 35, 9, 5]
    assert [x.max_tokens for x in (a, b, c, d)] == [3, 4, 2, 2]
    assert a.prompt[:32] == b.prompt[:32]  # blocks 0 and 1 shared
    assert a.prompt[32:35] != b.prompt[32:35]  # block 2 vs block 7
    assert c.prompt == a.prompt[16:25]  # block 1 at the front, cut to 9 tokens
    assert [s.arrival_s for s in sessions] == [0.0, 0.5, 1.5, 2.0]
    # the same seed gives the same blocks; another seed other ones
    again = trace_sessions(requests, TraceScaling(block_size=16), VOCAB, seed=2)
    assert again == sessions
    other = trace_sessions(requests, TraceScaling(block_size=16), VOCAB, seed=3)
    assert other[0].turns[0].prompt != a.prompt


def test_scaling_shrinks_lengths_blocks_and_time():
    request = TraceRequest(1000.0, 1000, 200, tuple(range(2)))
    scaling = TraceScaling(block_size=512, length_scale=1 / 32, time_scale=4.0)
    assert scaling.scaled_block_size == 16
    assert scaling.input_length(request) == 31  # round(1000 / 32)
    assert scaling.output_length(request) == 6  # round(200 / 32)
    assert TraceScaling(512, 1 / 32, output_scale=0.5).output_length(request) == 100
    # never longer than its scaled blocks, never shorter than 1
    assert TraceScaling(512, 0.05).input_length(TraceRequest(0, 1024, 1, (0, 1))) == 51
    assert TraceScaling(10, 1.0).input_length(TraceRequest(0, 35, 1, (0, 1))) == 20
    assert TraceScaling(512, 1e-6).input_length(request) == 1
    sessions = trace_sessions([TraceRequest(200.0, 64, 8, (0,)), request], scaling, VOCAB)
    assert [s.arrival_s for s in sessions] == [0.0, pytest.approx(3.2)]
    with pytest.raises(ValueError, match="--time-scale must be > 0"):
        TraceScaling(time_scale=0.0)


def test_load_trace_takes_the_first_lines_and_names_a_bad_one(tmp_path):
    good = {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}
    path = _trace(tmp_path, [good, good, good])
    assert len(load_trace(path, max_requests=2)) == 2
    path.write_text(json.dumps(good) + "\n" + '{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"line 2: not a trace request \(KeyError"):
        load_trace(path)
    with pytest.raises(ValueError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason="the shared synthetic trace is absent")
def test_the_synthetic_trace_maps_to_prefix_sharing_prompts():
    requests = load_trace(SHARED_TRACE, max_requests=200)
    sessions = trace_sessions(requests, TraceScaling(512, 1 / 32), VOCAB)
    seen: dict[int, tuple[int, ...]] = {}
    for request, session in zip(requests, sessions, strict=True):
        prompt = session.turns[0].prompt
        assert len(prompt) == TraceScaling(512, 1 / 32).input_length(request)
        for i, hash_id in enumerate(request.hash_ids[:-1]):  # full blocks only
            block = prompt[i * 16:(i + 1) * 16]
            assert seen.setdefault(hash_id, block) == block
