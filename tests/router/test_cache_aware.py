"""The --routing-policy modes over fixed pod reports (`SnapshotPool`) and a
real `PrefixIndex`: cache-aware routing sends a repeated prefix to the pod
that holds it, weighs it against load, keeps sessions sticky; round-robin and
session-sticky placement; a bad mode is refused by name."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from proto import pdserve_pb2
from router.cache_index.index import PrefixIndex, PromptBlocks
from router.routing.policy import RoutingPolicy
from router.routing.rendezvous import prefix_key, rank
from router.sessions import InMemorySessionStore
from tests.router.test_policy import DECODE, PREFILL, SnapshotPool, load

PROMPT = [(i * 13) % 500 + 7 for i in range(200)]


def make(mode: str, **prefill_fields: dict) -> tuple[RoutingPolicy, SnapshotPool, PrefixIndex]:
    pool = SnapshotPool([load(a, "prefill", **prefill_fields.get(a, {})) for a in PREFILL]
                        + [load(a, "decode") for a in DECODE])
    index = PrefixIndex()
    return RoutingPolicy(pool, InMemorySessionStore(), mode=mode, index=index), pool, index


def holds(index: PrefixIndex, address: str, tokens: list[int]) -> None:
    index.apply(pdserve_pb2.CacheEventBatch(
        address=address, role="prefill", generation=1, block_size=16, sequence=1,
        snapshot=True, stored=PromptBlocks(tokens + [0]).hashes(16)))


def choose(policy: RoutingPolicy, prompt: list[int], session: str | None = None) -> str:
    return asyncio.run(policy.choose_prefill(session_id=session, prompt_token_ids=prompt))


def test_cache_aware_sends_a_repeated_prefix_to_the_pod_that_holds_it():
    policy, _, index = make("cache-aware")
    # the pod the first-tokens hash would NOT pick holds the prompt
    holder = rank(prefix_key(PROMPT, 64), PREFILL)[-1]
    holds(index, holder, PROMPT[:160])
    for suffix in range(5):
        assert choose(policy, PROMPT + [suffix]) == holder
    # with nothing cached anywhere it falls back to the first-tokens ranking
    fresh = [t + 1 for t in PROMPT]
    assert choose(policy, fresh) == rank(prefix_key(fresh, 64), PREFILL)[0]


def test_cache_aware_weighs_the_cached_prefix_against_load():
    holder, other = PREFILL[0], PREFILL[1]
    # 160 cached tokens save 160 tokens of work; a queue of 300 costs more
    policy, _, index = make("cache-aware", **{
        holder: {"num_waiting_tokens": 300}, PREFILL[2]: {"num_waiting_tokens": 300},
        PREFILL[3]: {"num_waiting_tokens": 300}})
    holds(index, holder, PROMPT[:160])
    assert choose(policy, PROMPT) == other
    policy, _, index = make("cache-aware", **{
        holder: {"num_waiting_tokens": 100}, PREFILL[2]: {"num_waiting_tokens": 300},
        PREFILL[3]: {"num_waiting_tokens": 300}})
    holds(index, holder, PROMPT[:160])
    assert choose(policy, PROMPT) == holder  # 100 + 40 < 0 + 200


@pytest.mark.parametrize(("weight", "queue", "expected"), [
    (1.0, 300, "other"),    # 300 + 40 > 0 + 200: the idle pod
    (0.5, 300, "holder"),   # 150 + 40 < 200: the cache
    (0.0, 300, "holder"),   # load only bounds, never outweighs a hit
    (2.0, 100, "other"),    # 200 + 40 > 200: the same queue weighs double
    (1.0, 100, "holder"),   # 100 + 40 < 200
])
def test_the_load_weight_sets_how_much_a_queue_counts_against_a_hit(weight, queue, expected):
    holder, other = PREFILL[0], PREFILL[1]
    busy = {"num_waiting_tokens": queue}
    pool = SnapshotPool([load(holder, "prefill", **busy), load(other, "prefill"),
                         load(PREFILL[2], "prefill", **busy), load(PREFILL[3], "prefill", **busy)]
                        + [load(a, "decode") for a in DECODE])
    index = PrefixIndex()
    policy = RoutingPolicy(pool, InMemorySessionStore(), mode="cache-aware", index=index,
                           epsilon=10.0, cache_load_weight=weight)
    holds(index, holder, PROMPT[:160])
    assert choose(policy, PROMPT) == {"holder": holder, "other": other}[expected]


def test_a_load_weight_out_of_range_is_refused():
    pool = SnapshotPool([load(PREFILL[0], "prefill")])
    with pytest.raises(ValueError, match=r"cache-aware load weight must be in \[0, 100\]"):
        RoutingPolicy(pool, InMemorySessionStore(), mode="cache-aware", index=PrefixIndex(),
                      cache_load_weight=-0.5)
    from router import config

    with pytest.raises(ValueError, match=r"cache_aware_load_weight must be in \[0, 100\]"):
        config.RouterConfig(model_dir="m", cache_aware_load_weight=101)


def test_cache_aware_keeps_a_session_on_its_pod_within_the_load_bound():
    policy, _, index = make("cache-aware")
    home = choose(policy, PROMPT, session="chat-1")
    other = next(a for a in PREFILL if a != home)
    holds(index, other, PROMPT)  # another pod now caches more of it
    assert choose(policy, PROMPT + [1], session="chat-1") == home  # sticky


def test_round_robin_and_session_sticky_placement():
    policy, pool, _ = make("round-robin")
    assert [choose(policy, PROMPT, session="s") for _ in range(6)] == (PREFILL + PREFILL)[:6]
    policy, pool, _ = make("session-sticky", **{PREFILL[0]: {"num_waiting_tokens": 50}})
    no_session = [choose(policy, PROMPT) for _ in range(4)]
    assert PREFILL[0] not in no_session and len(set(no_session)) > 1  # least loaded, in turn
    assert len({choose(policy, [i], session="s") for i in range(5)}) == 1


def test_bad_mode_is_refused_by_name():
    pool = SnapshotPool([load(PREFILL[0], "prefill")])
    with pytest.raises(ValueError, match="routing policy must be one of first-tokens"):
        RoutingPolicy(pool, InMemorySessionStore(), mode="random")
    with pytest.raises(ValueError, match="cache-aware routing policy needs a prefix index"):
        RoutingPolicy(pool, InMemorySessionStore(), mode="cache-aware")


def test_local_prefill_counts_only_what_the_decode_pods_index_lacks():
    """The `cached_prefix` hook of router/routing/local_prefill.py, from the index:
    a 200-token prompt whose first 192 tokens decode pod B holds needs 8 new
    tokens there, under a 64-token limit; on A it needs all 200."""
    from router.routing.local_prefill import Ahead, LocalPrefill, LocalPrefillSettings

    pool = SnapshotPool([load(a, "decode") for a in DECODE])
    index = PrefixIndex()
    rule = LocalPrefill(pool, lambda exclude: Ahead(10_000), LocalPrefillSettings(max_tokens=64),
                        cached_prefix=index.cached_prefix)
    assert rule.choose(PROMPT, max_context=300, exclude=frozenset()) is None
    holds(index, DECODE[1], PROMPT)
    choice = rule.choose(PROMPT, max_context=300, exclude=frozenset())
    assert (choice.address, choice.new_tokens) == (DECODE[1], 200 - 192)


def test_router_config_and_flags_name_the_same_policies():
    import argparse

    from pdserve.commands import router as router_command
    from router import config
    from router.routing import cache_aware

    assert config.ROUTING_POLICIES == cache_aware.ROUTING_POLICIES
    parser = argparse.ArgumentParser()
    router_command.add_arguments(parser)
    (action,) = [a for a in parser._actions if a.dest == "routing_policy"]
    assert tuple(action.choices) == cache_aware.ROUTING_POLICIES
    args = parser.parse_args(["--model", "m", "--routing-policy", "cache-aware",
                              "--cache-index-blocks", "1000", "--cache-aware-load-weight", "0.25"])
    made = router_command.config_from_args(args)
    assert (made.routing_policy, made.cache_index_blocks) == ("cache-aware", 1000)
    assert made.cache_aware_load_weight == 0.25
    with pytest.raises(ValueError, match="routing_policy must be one of first-tokens"):
        config.RouterConfig(model_dir="m", routing_policy="random")
    with pytest.raises(ValueError, match=r"cache_index_blocks must be in \[1, 67108864\]"):
        config.RouterConfig(model_dir="m", cache_index_blocks=0)


def test_cache_aware_sends_a_follow_up_where_its_prefix_went_before_any_event():
    policy, pool, index = make("cache-aware")
    for address in PREFILL:
        holds(index, address, [])  # every pod heard from, nothing cached yet
    first = choose(policy, PROMPT)
    # the pod is now computing it (its queue shows it), and no stored event has come
    pool.loads[first] = dataclasses.replace(pool.loads[first], num_waiting_tokens=50)
    follow_up = PROMPT + [(i * 7) % 500 + 3 for i in range(40)]
    assert choose(policy, follow_up) == first  # 50 + 56 new tokens < 0 + 240
