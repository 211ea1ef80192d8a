"""RoutingPolicy (router/routing/policy.py) over a pool whose loads the test sets.

`SnapshotPool` is a real `PodPool` subclass holding fixed reports; the
in-flight accounting is the base class's own. Polling real pods is covered in
test_registry.py and test_routing_integration.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter

import pytest

from router.routing.base import NoPodAvailable, PodLoad, PodPool
from router.routing.policy import RoutingPolicy
from router.routing.rendezvous import prefix_key, rank, session_key
from router.sessions import InMemorySessionStore

PREFILL = ["127.0.0.1:6001", "127.0.0.1:6002", "127.0.0.1:6003", "127.0.0.1:6004"]
DECODE = ["127.0.0.1:7001", "127.0.0.1:7002"]


def load(address: str, role: str, **fields: int) -> PodLoad:
    base = dict(
        address=address, role=role, healthy=True, generation=1, num_waiting=0,
        num_waiting_tokens=0, num_running=0, num_free_blocks=100, num_total_blocks=100,
        block_size=16, prefix_hit_rate=0.0, in_flight=0,
    )
    base.update(fields)
    return PodLoad(**base)


class SnapshotPool(PodPool):
    def __init__(self, loads: list[PodLoad]) -> None:
        super().__init__()
        self.loads = {p.address: p for p in loads}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def pods(self, role: str) -> list[PodLoad]:
        out = []
        for p in sorted(self.loads.values(), key=lambda p: p.address):
            if p.role == role and p.healthy:
                requests, tokens = self.in_flight(p.address)
                out.append(dataclasses.replace(p, in_flight=requests, in_flight_tokens=tokens))
        return out

    def known(self, role: str) -> list[str]:
        return sorted(a for a, p in self.loads.items() if p.role == role)

    def mark_unhealthy(self, address: str, reason: str) -> None:
        self.loads[address] = dataclasses.replace(self.loads[address], healthy=False)


def make_policy(**kw: float) -> tuple[RoutingPolicy, SnapshotPool]:
    pool = SnapshotPool(
        [load(a, "prefill") for a in PREFILL] + [load(a, "decode") for a in DECODE]
    )
    return RoutingPolicy(pool, InMemorySessionStore(), **kw), pool


def test_session_goes_to_its_top_ranked_pod_every_time() -> None:
    policy, _ = make_policy()

    async def run() -> list[str]:
        return [
            await policy.choose_prefill(session_id="alice", prompt_token_ids=list(range(i + 1)))
            for i in range(50)
        ]

    chosen = asyncio.run(run())
    assert set(chosen) == {rank(session_key("alice"), PREFILL)[0]}


def test_sessions_spread_across_pods() -> None:
    policy, _ = make_policy()

    async def run() -> Counter[str]:
        return Counter(
            [await policy.choose_prefill(session_id=f"s{i}", prompt_token_ids=[1, 2])
             for i in range(400)]
        )

    counts = asyncio.run(run())
    assert set(counts) == set(PREFILL)
    assert all(60 <= n <= 140 for n in counts.values()), counts


def test_prefix_affinity_without_session() -> None:
    policy, _ = make_policy(block_size_for_affinity=8)
    system = list(range(100, 108))

    async def run() -> set[str]:
        return {
            await policy.choose_prefill(session_id=None, prompt_token_ids=system + [i, i + 1])
            for i in range(20)
        }

    assert asyncio.run(run()) == {rank(prefix_key(system, 8), PREFILL)[0]}


def test_overloaded_session_moves_to_next_ranked_pod_and_sticks() -> None:
    policy, pool = make_policy(epsilon=0.25)
    order = rank(session_key("bob"), PREFILL)

    async def run() -> tuple[str, str, str]:
        first = await policy.choose_prefill(session_id="bob", prompt_token_ids=[1] * 10)
        # its pod now has 4000 queued tokens, the others 0: avg 1000, bound 1250
        pool.loads[order[0]] = load(order[0], "prefill", num_waiting_tokens=4000)
        moved = await policy.choose_prefill(session_id="bob", prompt_token_ids=[1] * 10)
        # the overload is gone, but the new mapping sticks
        pool.loads[order[0]] = load(order[0], "prefill")
        after = await policy.choose_prefill(session_id="bob", prompt_token_ids=[1] * 10)
        return first, moved, after

    first, moved, after = asyncio.run(run())
    assert (first, moved, after) == (order[0], order[1], order[1])
    assert asyncio.run(policy.sessions.get("prefill", "bob")) == order[1]


def test_in_flight_tokens_count_toward_prefill_load() -> None:
    policy, pool = make_policy(epsilon=0.25)
    order = rank(session_key("carol"), PREFILL)

    async def run() -> str:
        return await policy.choose_prefill(session_id="carol", prompt_token_ids=[1] * 100)

    with policy.track(order[0], num_tokens=500), policy.track(order[0], num_tokens=500):
        assert pool.in_flight(order[0]) == (2, 1000)
        # load 1000 vs avg 250: over max(312.5, 250 + 100)
        assert asyncio.run(run()) == order[1]
    assert pool.in_flight(order[0]) == (0, 0)


def test_dead_mapped_pod_falls_back_and_exclude_skips() -> None:
    policy, pool = make_policy()
    order = rank(session_key("dave"), PREFILL)

    async def run() -> tuple[str, str]:
        await policy.choose_prefill(session_id="dave", prompt_token_ids=[1])
        pool.mark_unhealthy(order[0], "test")
        after_death = await policy.choose_prefill(session_id="dave", prompt_token_ids=[1])
        retried = await policy.choose_prefill(
            session_id="dave", prompt_token_ids=[1], exclude=frozenset({order[1]})
        )
        return after_death, retried

    assert asyncio.run(run()) == (order[1], order[2])


def test_no_pod_available_reason() -> None:
    policy, pool = make_policy()
    for a in PREFILL:
        pool.mark_unhealthy(a, "test")
    expected = r"no healthy prefill pod available \(4 known, 0 healthy\)"
    with pytest.raises(NoPodAvailable, match=expected):
        asyncio.run(policy.choose_prefill(session_id=None, prompt_token_ids=[1]))
    pool.mark_unhealthy(DECODE[1], "test")
    expected = r"no healthy decode pod available \(2 known, 1 healthy, 1 already tried\)"
    with pytest.raises(NoPodAvailable, match=expected):
        policy.choose_decode(num_tokens=10, exclude=frozenset({DECODE[0], "x:1"}))


def test_decode_prefers_room_then_fewest_running() -> None:
    policy, pool = make_policy()
    a, b = DECODE
    pool.loads[a] = load(a, "decode", num_running=5, num_free_blocks=90)
    pool.loads[b] = load(b, "decode", num_running=1, num_free_blocks=3)
    assert policy.choose_decode(num_tokens=32) == b  # needs 2 blocks, both fit; b runs fewer
    assert policy.choose_decode(num_tokens=64) == a  # needs 4 blocks: only a has room
    with policy.track(b), policy.track(b), policy.track(b), policy.track(b), policy.track(b):
        # b: 1 running + 5 in flight = 6 > a's 5
        assert policy.choose_decode(num_tokens=32) == a
    assert policy.choose_decode(num_tokens=32, exclude=frozenset({b})) == a


def test_decode_too_large_for_every_pod() -> None:
    policy, _ = make_policy()
    expected = "needs KV for 1601 tokens; the largest decode pod holds 1600"
    with pytest.raises(NoPodAvailable, match=expected):
        policy.choose_decode(num_tokens=1601)
    # full by the last report but large enough: still chosen (the pod has the final word)
    assert policy.choose_decode(num_tokens=1600) in DECODE


def test_colocated_uses_request_counts() -> None:
    pool = SnapshotPool([load(f"127.0.0.1:{8000 + i}", "colocated") for i in range(3)])
    policy = RoutingPolicy(pool, InMemorySessionStore())
    addresses = [p.address for p in pool.pods("colocated")]
    order = rank(session_key("erin"), addresses)
    pool.loads[order[0]] = load(order[0], "colocated", num_running=6, num_waiting=3)

    async def run() -> str:
        return await policy.choose_colocated(session_id="erin", prompt_token_ids=[1])

    assert asyncio.run(run()) == order[1]  # 9 > max(1.25 * 3, 3 + 1)


def test_policy_validation() -> None:
    pool = SnapshotPool([])
    with pytest.raises(ValueError, match=r"epsilon must be in \[0, 10\]"):
        RoutingPolicy(pool, InMemorySessionStore(), epsilon=-1)
    with pytest.raises(ValueError, match="block_size_for_affinity must be > 0"):
        RoutingPolicy(pool, InMemorySessionStore(), block_size_for_affinity=0)
    with pytest.raises(ValueError, match="PodLoad.num_free_blocks must be >= 0"):
        load("a:1", "decode", num_free_blocks=-1)
    with pytest.raises(ValueError, match="pod address must be host:port"):
        load("nope", "decode")
    with pytest.raises(ValueError, match="track\\(num_tokens\\) must be >= 0"):
        with pool.track("a:1", num_tokens=-1):
            pass


@pytest.mark.timeout(30)
def test_sessions_route_by_hash_alone_while_redis_is_down(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    from router.sessions import RedisSessionStore, SessionStoreError
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path)
    pool = SnapshotPool([load(a, "prefill") for a in PREFILL])
    store = RedisSessionStore(server.url, timeout_s=0.3)
    policy = RoutingPolicy(pool, store)
    order = rank(session_key("frank"), PREFILL)

    async def run() -> tuple[str, str, str]:
        try:
            # mapped to the 3rd-ranked pod while Redis is up
            assert await store.assign("prefill", "frank", None, order[2]) == order[2]
            up = await policy.choose_prefill(session_id="frank", prompt_token_ids=[1])
            server.stop()
            with pytest.raises(SessionStoreError, match="session store get failed"):
                await store.get("prefill", "frank")
            started = time.monotonic()
            down = await policy.choose_prefill(session_id="frank", prompt_token_ids=[1])
            again = await policy.choose_prefill(session_id="frank", prompt_token_ids=[1])
            assert time.monotonic() - started < 2.0  # bounded by the store timeout
            return up, down, again
        finally:
            await store.close()

    up, down, again = asyncio.run(run())
    assert (up, down, again) == (order[2], order[0], order[0])
    warnings = [r for r in caplog.records if "routing sessions by hash only" in r.message]
    assert len(warnings) == 1  # rate-limited: one line, not one per request
