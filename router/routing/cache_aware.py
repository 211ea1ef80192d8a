"""How a request without a sticky pod is placed: the `--routing-policy` modes.

`RoutingPolicy` (router/routing/policy.py) keeps a session on its mapped pod
while that pod is within the load bound, in every mode but round-robin; what
differs is where a request goes when no mapping decides (no session, a new
session, or its pod overloaded):

    first-tokens    rendezvous ranking of the session id, else of the first 64
    (default)       prompt tokens; the first pod within the load bound
    session-sticky  rendezvous ranking of the session id; without a session
                    the least-loaded pod (ties: in turn)
    cache-aware     among pods within the load bound, the least
                    `load + tokens to compute` (below); ties by the rendezvous
                    ranking of the session id or first 64 prompt tokens
    round-robin     the next pod in turn, whatever the session, prefix or load

Cache-aware cost of a prefill pod: its load (prompt tokens queued or in
flight, `RoutingPolicy` module docstring) times the load weight
(`--cache-aware-load-weight`, default 1) plus the prompt tokens it would
compute, the prompt less the prefix its prefix cache holds as far as its
events tell (router/cache_index/index.py). Both are tokens of prefill work
ahead of this request's first token, so with weight 1 a long cached prefix
on a busy pod wins over an idle pod exactly when it saves more than the
queue costs: right when every pod has its own compute. Pods that share
compute (several on one node's cores) all wait on the same cores, so a
queue on one is not time saved on another but a hit is work nobody does:
a weight below 1 keeps prompts with their caches (the load bound still
caps any one pod's queue). For
colocated pods (loads in requests) the cost is the tokens to compute alone;
the load bound keeps them balanced.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

from router.cache_index.index import PrefixIndex, PromptBlocks
from router.routing.rendezvous import first_ranked

ROUTING_POLICIES = ("first-tokens", "session-sticky", "cache-aware", "round-robin")


def check_load_weight(weight: float) -> float:
    if not 0.0 <= weight <= 100.0:
        raise ValueError(f"cache-aware load weight must be in [0, 100], got {weight}")
    return weight


def check_routing_policy(name: str) -> str:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, "
                         f"got {name!r}")
    return name


def choose_cache_aware(key: bytes, loads: Mapping[str, float], bound: float,
                       prompt: PromptBlocks, index: PrefixIndex, *, tokens_load: bool,
                       load_weight: float = 1.0) -> str:
    """The pod within `bound` with the least cost (module docstring); ties
    go to the first in `key`'s rendezvous ranking."""
    weight = load_weight if tokens_load else 0.0
    cached = index.holders(prompt, among=loads.keys())  # the others compute it all
    length = len(prompt)
    best_cost, tied = math.inf, []
    for address, load in loads.items():
        if load > bound:
            continue
        cost = weight * load + (length - cached.get(address, 0))
        if cost < best_cost:
            best_cost, tied = cost, [address]
        elif cost == best_cost:
            tied.append(address)
    # equal costs (idle pods, nothing cached): the first in the key's ranking,
    # hashing only those pods
    return tied[0] if len(tied) == 1 else first_ranked(key, tied)


class RoundRobin:
    """Turns per role; `next` takes the pod after the previous one's turn."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    def turn(self, role: str) -> int:
        counter = self._counters.setdefault(role, itertools.count())
        return next(counter)

    def next(self, role: str, addresses: list[str]) -> str:
        ordered = sorted(addresses)
        return ordered[self.turn(role) % len(ordered)]

    def least_loaded(self, role: str, loads: Mapping[str, float]) -> str:
        """The least-loaded pod; among equals, the one whose turn it is."""
        ordered = sorted(loads)
        start = self.turn(role) % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        return min(rotated, key=lambda a: loads[a])
