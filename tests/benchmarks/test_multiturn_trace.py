"""`pdserve bench multiturn-trace`: chats whose turns overlap in time, in the
Mooncake format that `bench routing` replays and reads conversations from."""

from __future__ import annotations

import argparse
import json

from benchmarks import multiturn_trace
from benchmarks.routing_trace import conversation_ids, oracle_hit_ratio
from benchmarks.serve_trace import TraceScaling, load_trace


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    multiturn_trace.add_arguments(parser)
    return parser.parse_args(argv)


def test_turns_extend_their_conversation_and_overlap(tmp_path, capsys):
    out = tmp_path / "chat.jsonl"
    argv = ["--out", str(out), "--conversations", "12", "--turns", "3-5",
            "--turn-gap", "0.5-1", "--system-prompts", "2", "--seed", "3"]
    assert multiturn_trace.main(_args(argv)) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert 36 <= len(lines) <= 60
    assert "in 12 conversations" in capsys.readouterr().out
    assert [line["timestamp"] for line in lines] == sorted(line["timestamp"] for line in lines)
    for line in lines:
        # one id per 512-token block, the last one partial or full
        assert len(line["hash_ids"]) == -(-line["input_length"] // 512)
        assert line["hash_ids"][:2] in ([0, 1], [2, 3])  # one of the two system prompts
    # each line after a conversation's first continues an earlier line: it starts
    # with that line's full blocks, and its prompt holds that prompt and its answer
    firsts = 0
    for i, line in enumerate(lines):
        earlier = [e for e in lines[:i]
                   if line["hash_ids"][:e["input_length"] // 512]
                   == e["hash_ids"][:e["input_length"] // 512]
                   and line["input_length"] > e["input_length"] + e["output_length"]]
        firsts += not earlier
    assert firsts <= 12 + 2  # conversation openers (two could look alike by their system ids)
    # the routing bench reads the same conversations back
    requests = load_trace(out, 1000)
    scaling = TraceScaling(512, 1 / 32, 1 / 32, 1.0)
    assert oracle_hit_ratio(requests, scaling) > 0.5
    # the same flags write the same file
    again = tmp_path / "again.jsonl"
    assert multiturn_trace.main(_args([*argv[:1], str(again), *argv[2:]])) == 0
    assert again.read_text() == out.read_text()


def test_the_routing_bench_reads_the_conversations_back(tmp_path):
    """Without shared system prompts (which make two openers look like one
    conversation to benchmarks/routing_trace.py's rule) and with every prompt
    at least one full block (a lone partial block is shared by no next turn),
    every turn is attributed to its own conversation."""
    lines = multiturn_trace.make_trace(10, 1.0, (2, 4), (0.2, 0.5), 1, 0, (64, 512), seed=7,
                                       message_tokens=(600, 1500))
    out = tmp_path / "chat.jsonl"
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ids = conversation_ids(load_trace(out))
    assert len(set(ids)) == 10
    # the turns of a conversation overlap: each next turn arrives within 0.5 s
    by_conversation: dict[str, list[int]] = {}
    for line, conversation in zip(lines, ids, strict=True):
        by_conversation.setdefault(conversation, []).append(line["timestamp"])
    gaps = [b - a for times in by_conversation.values()
            for a, b in zip(times[:-1], times[1:], strict=True)]
    assert gaps and all(199 <= gap <= 501 for gap in gaps)  # ms, rounded


def test_bad_ranges_are_refused_by_name(tmp_path, capsys):
    for argv, message in ((["--turns", "5-3"], "--turns '5-3': needs 0 <= MIN <= MAX"),
                          (["--turn-gap", "x"], "--turn-gap 'x': expected MIN-MAX"),
                          (["--conversations", "0"], "--conversations must be >= 1")):
        assert multiturn_trace.main(_args(["--out", str(tmp_path / "t"), *argv])) == 2
        assert message in capsys.readouterr().err
