"""The pool's views kept current by change (router/registry/pod_views.py)
and the decode choice that walks them (`RoutingPolicy.choose_decode`).

A `PolledPodPool` over a static list of addresses is driven through random
sequences of what changes a pod on the router's event loop (a report
applied, a failed poll, `mark_unhealthy`, requests tracked and finished)
without a network, and after every step its answers are compared with ones
computed from scratch: `pods()` with the healthy records sorted by address,
`by_load()` with those sorted by `load_key`, and the decode choice with the
full-scan ranking (`_reference_decode`, the rule as the policy's docstring
states it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random

import pytest

from proto import pdserve_pb2
from router.registry.pod_state import PodState
from router.registry.poller import PolledPodPool
from router.registry.static import StaticPodSource
from router.routing.base import NoPodAvailable, PodLoad, load_key
from router.routing.policy import RoutingPolicy
from router.sessions import InMemorySessionStore

PREFILL = [f"10.0.0.{i}:9000" for i in range(1, 9)]
DECODE = [f"10.0.1.{i}:9000" for i in range(1, 25)]


def _with_pool(test) -> None:
    """Run `test(pool, rng)` on an event loop (the pool's channels need one),
    every pod healthy with a random first report."""
    async def body() -> None:
        pool = PolledPodPool(StaticPodSource(prefill=PREFILL, decode=DECODE), watch=False)
        pool._sync(await pool._source.discover())
        rng = random.Random(len(PREFILL))
        for record in pool._pods.values():
            pool._apply(record, _report(rng, record.entry.role), "first report")
        try:
            test(pool)
        finally:
            await pool.close()
    asyncio.run(body())


def _report(rng: random.Random, role: str) -> pdserve_pb2.LoadReport:
    total = rng.choice([8, 40, 64])
    return pdserve_pb2.LoadReport(role=role, generation=1, num_running=rng.randint(0, 4),
                                  num_waiting_tokens=rng.randint(0, 900),
                                  num_free_blocks=rng.randint(0, total),
                                  num_total_blocks=total, block_size=rng.choice([16, 32]))


def _expected_pods(pool: PolledPodPool, role: str) -> list[tuple[str, int, int, int]]:
    """(address, running, free blocks, in flight) of the healthy pods, from the records."""
    rows = []
    for address, record in sorted(pool._pods.items()):
        if record.entry.role == role and record.state is PodState.HEALTHY:
            rows.append((address, record.report.num_running, record.report.num_free_blocks,
                         pool.in_flight(address)[0]))
    return rows


def _rows(loads: list[PodLoad]) -> list[tuple[str, int, int, int]]:
    return [(p.address, p.num_running, p.num_free_blocks, p.in_flight) for p in loads]


def _reference_decode(pods: list[PodLoad], num_tokens: int, exclude: frozenset[str]) -> str:
    """The least-loaded decode ranking by a full scan: pods that can ever hold
    the request, those with room first, then `load_key`."""
    fitting = [p for p in pods if p.address not in exclude
               and math.ceil(num_tokens / p.block_size) <= p.num_total_blocks]
    if not fitting:
        raise NoPodAvailable("none fits")
    return min(fitting, key=lambda p: (math.ceil(num_tokens / p.block_size)
                                       > p.num_free_blocks, load_key(p))).address


def _step(rng: random.Random, pool: PolledPodPool, held: list) -> None:
    address = rng.choice(PREFILL + DECODE)
    record = pool._pods[address]
    action = rng.random()
    if action < 0.45:
        pool._apply(record, _report(rng, record.entry.role), "report")
    elif action < 0.5:
        pool._poll_failed(record, "refused", slow=False)
    elif action < 0.53:
        pool.mark_unhealthy(address, "connect failed")
    elif action < 0.8 or not held:
        track = pool.track(address, num_tokens=rng.randint(0, 300))
        track.__enter__()
        held.append(track)
    else:
        held.pop(rng.randrange(len(held))).__exit__(None, None, None)


@pytest.mark.parametrize("seed", range(6))
def test_views_and_the_decode_choice_match_a_full_scan_after_every_change(seed: int) -> None:
    _with_pool(lambda pool: _random_changes(pool, random.Random(seed)))


def _random_changes(pool: PolledPodPool, rng: random.Random) -> None:
    policy = RoutingPolicy(pool, InMemorySessionStore())
    held: list[contextlib.AbstractContextManager] = []
    for _ in range(400):
        _step(rng, pool, held)
        for role in ("prefill", "decode"):
            pods = pool.pods(role)
            assert _rows(pods) == _expected_pods(pool, role)
            assert [p.address for p in pool.by_load(role)] == \
                [p.address for p in sorted(pods, key=load_key)]
            assert pool.addresses(role) == {p.address for p in pods}
            for p in pods:
                assert pool.pod(role, p.address) == p
        decode = pool.pods("decode")
        num_tokens = rng.choice([20, 300, 900, 5000])
        exclude = frozenset(rng.sample(DECODE, rng.choice([0, 0, 3])))
        try:
            expected = _reference_decode(decode, num_tokens, exclude)
        except NoPodAvailable:
            with pytest.raises(NoPodAvailable):
                policy.choose_decode(num_tokens=num_tokens, exclude=exclude)
        else:
            assert policy.choose_decode(num_tokens=num_tokens, exclude=exclude) == expected
    for track in held:
        track.__exit__(None, None, None)
    assert all(p.in_flight == 0 for p in pool.pods("decode"))


def test_a_pod_set_change_rebuilds_the_views() -> None:
    _with_pool(_pod_set_change)


def _pod_set_change(pool: PolledPodPool) -> None:
    assert len(pool.pods("decode")) == len(DECODE)
    pool._sync([entry for entry in pool._source._entries if entry.address != DECODE[0]])
    # a HEALTHY pod missing from the registry stays within its grace
    assert DECODE[0] in pool.addresses("decode")
    pool.mark_unhealthy(DECODE[0], "gone")
    assert DECODE[0] not in pool.addresses("decode")
    assert [p.address for p in pool.by_load("decode")] == \
        [p.address for p in sorted(pool.pods("decode"), key=load_key)]


def test_a_request_too_large_for_every_pod_and_no_pod_left_say_why() -> None:
    _with_pool(_refusals)


def _refusals(pool: PolledPodPool) -> None:
    policy = RoutingPolicy(pool, InMemorySessionStore())
    with pytest.raises(NoPodAvailable, match="the largest decode pod holds"):
        policy.choose_decode(num_tokens=10**7)
    with pytest.raises(NoPodAvailable, match="no healthy decode pod available"):
        policy.choose_decode(num_tokens=10, exclude=frozenset(DECODE))


def test_a_round_polls_at_most_its_bound_the_longest_unpolled_first() -> None:
    """300 new pods (nothing listens: each poll is refused at once): a round
    polls MAX_POLLS_PER_ROUND of them, the next round the rest first. The
    ports are held bound, not listening, for the test: fixed ports in the
    ephemeral range could be another test's pod under a second worker (a
    clean-clone run saw one answer)."""
    import socket

    from router.registry.pod_state import MAX_POLLS_PER_ROUND, longest_unpolled

    held = [socket.socket() for _ in range(300)]
    for sock in held:
        sock.bind(("127.0.0.1", 0))

    async def body() -> None:
        addresses = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in held]
        pool = PolledPodPool(StaticPodSource(decode=addresses), watch=False,
                             poll_timeout=5.0)
        try:
            await pool.poll_once()
            polled = {a for a, record in pool._pods.items() if record.polled_at}
            assert len(polled) == MAX_POLLS_PER_ROUND == 256
            await pool.poll_once()
            again = {a for a, record in pool._pods.items() if record.polled_at}
            assert again == set(addresses)  # the 44 never polled went first
            assert all(pool.state(a)[0] is PodState.UNHEALTHY for a in addresses)
        finally:
            await pool.close()

    try:
        asyncio.run(body())
    finally:
        for sock in held:
            sock.close()
    records = [type("R", (), {"polled_at": t})() for t in (5.0, 0.0, 3.0, 1.0)]
    assert [r.polled_at for r in longest_unpolled(records, 2)] == [0.0, 1.0]
    assert longest_unpolled(records, 4) is records
