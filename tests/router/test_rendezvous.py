"""Rendezvous hashing and bounded load (router/routing/rendezvous.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import xxhash

from router.routing.rendezvous import (
    choose_bounded,
    overload_bound,
    prefix_key,
    rank,
    score,
    session_key,
)

PODS = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051", "10.0.0.4:50051"]


def test_score_is_xxhash64_of_key_nul_address() -> None:
    assert score(b"abc", "h:1") == xxhash.xxh64_intdigest(b"abc\x00h:1")


def test_rank_is_stable_and_independent_of_input_order() -> None:
    key = session_key("user-42")
    first = rank(key, PODS)
    assert sorted(first) == sorted(PODS)
    assert rank(key, list(reversed(PODS))) == first
    assert rank(key, PODS) == first
    expected = sorted(PODS, key=lambda a: -xxhash.xxh64_intdigest(key + b"\x00" + a.encode()))
    assert first == expected


def test_keys_spread_roughly_evenly_over_four_pods() -> None:
    counts = Counter(rank(session_key(f"s{i}"), PODS)[0] for i in range(4000))
    assert set(counts) == set(PODS)
    # 1000 expected each; binomial sd ~27, so 850..1150 is > 5 sd
    assert all(850 <= n <= 1150 for n in counts.values()), counts


def test_removing_a_pod_moves_only_its_keys_to_their_next_ranked_pod() -> None:
    keys = [session_key(f"s{i}") for i in range(2000)]
    before = {k: rank(k, PODS) for k in keys}
    removed = PODS[2]
    survivors = [p for p in PODS if p != removed]
    moved = 0
    for k in keys:
        after = rank(k, survivors)[0]
        if before[k][0] == removed:
            moved += 1
            assert after == before[k][1]
        else:
            assert after == before[k][0]
    assert 400 <= moved <= 600


def test_adding_a_pod_takes_only_keys_that_now_rank_it_first() -> None:
    keys = [session_key(f"s{i}") for i in range(2000)]
    grown = [*PODS, "10.0.0.5:50051"]
    for k in keys:
        old, new = rank(k, PODS)[0], rank(k, grown)[0]
        assert new in (old, "10.0.0.5:50051")


def test_overload_bound_is_max_of_ratio_and_slack() -> None:
    loads = {"a:1": 100.0, "b:1": 100.0, "c:1": 100.0, "d:1": 100.0}
    assert overload_bound(loads, epsilon=0.25, slack=1.0) == 125.0
    assert overload_bound(loads, epsilon=0.25, slack=50.0) == 150.0
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        overload_bound(loads, epsilon=-0.1, slack=1.0)
    with pytest.raises(ValueError, match="at least one pod"):
        overload_bound({}, epsilon=0.25, slack=1.0)


def test_bounded_load_keeps_top_pod_until_over_bound_then_next_ranked() -> None:
    key = session_key("alice")
    order = rank(key, PODS)
    loads = dict.fromkeys(PODS, 10.0)
    assert choose_bounded(key, loads, epsilon=0.25, slack=1.0) == order[0]
    # average 12.5 -> bound 15.625: 20 is over it
    loads[order[0]] = 20.0
    assert choose_bounded(key, loads, epsilon=0.25, slack=1.0) == order[1]
    # the second choice overloaded too -> the third
    loads[order[1]] = 20.0
    assert choose_bounded(key, loads, epsilon=0.25, slack=1.0) == order[2]


def test_slack_keeps_a_single_request_from_moving_its_key() -> None:
    key = session_key("bob")
    top = rank(key, PODS)[0]
    loads = dict.fromkeys(PODS, 0.0)
    loads[top] = 1.0  # average 0.25: above (1+eps)*avg, but within avg + one request
    assert choose_bounded(key, loads, epsilon=0.25, slack=1.0) == top
    loads[top] = 2.0
    assert choose_bounded(key, loads, epsilon=0.25, slack=1.0) != top


def test_preferred_pod_sticks_while_within_bound() -> None:
    key = session_key("carol")
    order = rank(key, PODS)
    loads = dict.fromkeys(PODS, 4.0)
    assert choose_bounded(key, loads, epsilon=0.25, slack=1.0, preferred=order[3]) == order[3]
    loads[order[3]] = 9.0  # avg 5.25 -> bound 6.5625
    assert choose_bounded(key, loads, epsilon=0.25, slack=1.0, preferred=order[3]) == order[0]
    # a preferred pod that is not a candidate is ignored
    assert choose_bounded(key, loads, epsilon=0.25, slack=1.0, preferred="gone:1") == order[0]


def test_prefix_key_uses_only_the_first_tokens() -> None:
    a = prefix_key([1, 2, 3, 4, 5, 6], 4)
    assert a == prefix_key([1, 2, 3, 4, 99], 4)
    assert a != prefix_key([1, 2, 3, 5, 5, 6], 4)
    assert prefix_key([7, 8], 4) == b"p:" + (7).to_bytes(4, "little") + (8).to_bytes(4, "little")
    assert prefix_key([1], 4) != session_key("x")
    with pytest.raises(ValueError, match="affinity prefix length must be > 0"):
        prefix_key([1, 2], 0)
