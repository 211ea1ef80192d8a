"""The prefix-aware decode choice (`RoutingPolicy.choose_decode`, router/
routing/policy.py): among decode pods with room and within the load bound,
the one whose prefix cache holds the longest prefix of the prompt wins;
above the bound, without an index, or with nothing cached, the least-loaded
order stands. A decode pod that prefills a prompt itself
(`LocalPrefill.choose`) is ranked by the same rule. The index is a real
`PrefixIndex` fed real `CacheEventBatch` messages hashed as the pods hash
them.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.decision import full_ranking
from proto import pdserve_pb2
from router.cache_index.index import PrefixIndex, PromptBlocks
from router.routing.base import NoPodAvailable
from router.routing.local_prefill import Ahead, LocalPrefill, LocalPrefillSettings
from router.routing.policy import RoutingPolicy
from router.sessions import InMemorySessionStore
from tests.router.test_policy import DECODE, SnapshotPool, load

BLOCK = 16
PROMPT = list(range(100, 100 + 8 * BLOCK + 5))  # 8 full blocks and a tail
A, B = DECODE  # A sorts first: the least-loaded order's pick among equals


def _publish(index: PrefixIndex, address: str, num_blocks: int) -> None:
    """`address` says (a snapshot) it caches the prompt's first `num_blocks` blocks."""
    hashes = PromptBlocks(PROMPT).hashes(BLOCK)[:num_blocks]
    index.apply(pdserve_pb2.CacheEventBatch(address=address, role="decode", generation=1,
                                            block_size=BLOCK, sequence=1, snapshot=True,
                                            stored=hashes))


def _policy(index: PrefixIndex | None, **loads: dict) -> tuple[RoutingPolicy, SnapshotPool]:
    pool = SnapshotPool([load(A, "decode", **loads.get("a", {})),
                         load(B, "decode", **loads.get("b", {}))])
    return RoutingPolicy(pool, InMemorySessionStore(), index=index), pool


def _choose(policy: RoutingPolicy, prompt=PROMPT) -> str:
    return policy.choose_decode(num_tokens=len(PROMPT) + 16, prompt_token_ids=prompt)


def test_the_longer_cached_prefix_wins_within_the_bound() -> None:
    index = PrefixIndex()
    _publish(index, A, 2)
    _publish(index, B, 6)
    # B runs one more sequence: still within max((1+0.25) x 1.5, 1.5 + 1) = 2.5
    policy, _ = _policy(index, a={"num_running": 1}, b={"num_running": 2})
    assert _choose(policy) == B
    # prefix-blind (no prompt): the least-loaded pod, as before
    assert policy.choose_decode(num_tokens=len(PROMPT) + 16) == A
    # a pod that failed this request is left out, cached or not
    assert policy.choose_decode(num_tokens=len(PROMPT) + 16, prompt_token_ids=PROMPT,
                                exclude=frozenset({B})) == A


def test_a_cached_pod_above_the_load_bound_counts_nothing() -> None:
    index = PrefixIndex()
    _publish(index, B, 8)
    # bound: max(1.25 x 3, 3 + 1) = 4; B at 6 is above it, A at 0 below
    policy, _ = _policy(index, b={"num_running": 6})
    assert _choose(policy) == A
    # in-flight requests count toward the bound too
    policy, pool = _policy(index, b={"num_running": 2})
    assert _choose(policy) == B
    with pool.track(B), pool.track(B), pool.track(B), pool.track(B):
        assert _choose(policy) == A  # B: 2 + 4 = 6 > max(3.75, 4)


def test_room_comes_before_the_cached_prefix() -> None:
    index = PrefixIndex()
    _publish(index, B, 8)
    # B's last report shows too few free blocks for prompt + max_tokens
    policy, _ = _policy(index, b={"num_free_blocks": 2})
    assert _choose(policy) == A


def test_without_an_index_or_a_hit_the_order_is_least_loaded() -> None:
    policy, _ = _policy(None, a={"num_running": 1})
    assert _choose(policy) == B
    index = PrefixIndex()
    _publish(index, A, 0)
    _publish(index, B, 0)
    policy, _ = _policy(index, a={"num_running": 1})
    assert _choose(policy) == B
    # equal cached prefixes: least-loaded among them
    _publish(index, A, 3)
    _publish(index, B, 3)
    policy, _ = _policy(index, a={"num_running": 1})
    assert _choose(policy) == B
    # another prompt (different first block) hits nowhere
    other = [7] + PROMPT[1:]
    policy, _ = _policy(index, b={"num_running": 1})
    assert _choose(policy, other) == A


def _local_rule(index: PrefixIndex, pool: SnapshotPool) -> LocalPrefill:
    """A decode pod prefills any prompt below 1000 new tokens itself."""
    return LocalPrefill(pool, lambda exclude: Ahead(0), LocalPrefillSettings(below=1000),
                        cached_prefix=index.cached_prefix)


def _local(rule: LocalPrefill, prompt=PROMPT) -> str:
    choice = rule.choose(prompt, max_context=len(PROMPT) + 16, exclude=frozenset())
    return choice.address


def test_a_local_prefill_ranks_decode_pods_by_the_same_rule() -> None:
    """`LocalPrefill.choose` (router/routing/local_prefill.py): the longest
    cached prefix within the load bound, as `choose_decode` ranks them."""
    index = PrefixIndex()
    _publish(index, A, 2)
    _publish(index, B, 6)
    policy, pool = _policy(index, a={"num_running": 1}, b={"num_running": 2})
    rule = _local_rule(index, pool)
    assert _local(rule) == _choose(policy) == B
    assert rule.choose(PROMPT, max_context=200, exclude=frozenset()).new_tokens == 133 - 96
    # B above the bound (max(1.25 x 3.5, 4.5) = 4.5): its cache counts nothing
    policy, pool = _policy(index, a={"num_running": 1}, b={"num_running": 6})
    assert _local(_local_rule(index, pool)) == _choose(policy) == A
    # another prompt hits nowhere: least-loaded
    other = [7] + PROMPT[1:]
    policy, pool = _policy(index, a={"num_running": 1})
    assert _local(_local_rule(index, pool), other) == _choose(policy, other) == B


def test_the_choice_equals_a_ranking_of_every_pod_on_random_pools() -> None:
    """The choice asks the index for the prompt's holders only and walks the
    load order; `full_ranking` ranks every pod by the whole rule."""
    rng = random.Random(7)
    for case in range(300):
        addresses = [f"10.0.0.{i}:9000" for i in range(rng.randint(1, 12))]
        pool = SnapshotPool([load(a, "decode", num_running=rng.randint(0, 6),
                                  num_free_blocks=rng.randint(0, 12),
                                  num_total_blocks=rng.choice([6, 12, 40]))
                             for a in addresses])
        index = PrefixIndex()
        for a in addresses:
            if rng.random() < 0.6:
                _publish(index, a, rng.randint(0, 8))
        policy = RoutingPolicy(pool, InMemorySessionStore(), index=index)
        for a in rng.sample(addresses, rng.randint(0, len(addresses))):
            for _ in range(rng.randint(0, 3)):
                pool.track(a).__enter__()  # in flight toward a, never ended
        exclude = frozenset(rng.sample(addresses, rng.randint(0, len(addresses) // 3)))
        prompt = PROMPT if rng.random() < 0.8 else [7] + PROMPT[1:]
        num_tokens = rng.choice([len(PROMPT) + 16, 20 * BLOCK, 45 * BLOCK])
        pods = [p for p in pool.pods("decode") if p.address not in exclude]
        expected = full_ranking(pods, num_tokens, index, prompt)
        if expected is None:
            with pytest.raises(NoPodAvailable):
                policy.choose_decode(num_tokens=num_tokens, prompt_token_ids=prompt,
                                     exclude=exclude)
            continue
        got = policy.choose_decode(num_tokens=num_tokens, prompt_token_ids=prompt,
                                   exclude=exclude)
        assert got == expected, f"case {case}"
