"""Stop strings split across pieces are found; held text is released exactly once."""

from __future__ import annotations

import pytest

from router.flow.stop_strings import StopMatcher


def _run(stops, pieces):
    matcher = StopMatcher(stops)
    out = [matcher.push(p) for p in pieces]
    return out, matcher


def test_no_stops_passes_through():
    out, m = _run([], ["a", "b"])
    assert out == ["a", "b"] and m.flush() == "" and not m.stopped


def test_match_across_pieces():
    out, m = _run(["END"], ["hello E", "N", "D and more"])
    assert out == ["hello ", "", ""]
    assert m.stopped and m.flush() == ""
    assert m.push("later") == ""


def test_partial_prefix_released_when_it_does_not_match():
    out, m = _run(["abc"], ["xa", "b", "d", "ab"])
    assert out == ["x", "", "abd", ""]
    assert not m.stopped and m.flush() == "ab"


def test_earliest_of_several_stops_wins():
    out, m = _run(["world", "lo w"], ["hello world"])
    assert out == ["hel"] and m.stopped


def test_stop_inside_one_piece_and_at_start():
    assert _run(["\n"], ["line one\nline two"])[0] == ["line one"]
    assert _run(["##"], ["##x"])[0] == [""]


def test_rejects_empty_stop():
    with pytest.raises(ValueError, match="must not be empty"):
        StopMatcher([""])
