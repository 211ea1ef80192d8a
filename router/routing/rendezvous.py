"""Rendezvous (highest-random-weight) hashing with bounded load.

Every pod gets a score `xxhash64(key || 0x00 || address)` for a key (a session
id, or the hash of a prompt's first block); the pods sorted by descending score
are the key's *ranking*. Properties the policy relies on:

* stable: the ranking depends only on the key and the set of addresses, so
  every router replica computes the same one without talking to the others;
* minimal movement: removing a pod moves only the keys that ranked it first
  (each to its own next-ranked pod); adding one takes only the keys that now
  rank it first;
* spread: keys are spread evenly because the scores are independent hashes.

Bounded load (`choose_bounded`) then walks the ranking and takes the first pod
that is not overloaded. A pod is overloaded when its load exceeds
`(1 + epsilon) × average load` — and also exceeds `average + slack`, where
`slack` is one request's worth of load. The second condition exists because
loads are coarse and polled: with four idle pods and one request in flight,
the average is 0.25 and that single request would otherwise push its own
session off its pod. The least-loaded pod is never overloaded (it is at or
below the average), so a choice always exists.

Pure functions, no state: called by `RoutingPolicy` on the router's event loop.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence

import xxhash

SEPARATOR = b"\x00"  # addresses never contain NUL, so key||NUL||address is unambiguous


def score(key: bytes, address: str) -> int:
    """The rendezvous weight of `address` for `key` (a 64-bit unsigned integer)."""
    return xxhash.xxh64_intdigest(key + SEPARATOR + address.encode())


def rank(key: bytes, addresses: Iterable[str]) -> list[str]:
    """`addresses` ordered best-first for `key`; ties (never seen in practice) break by address."""
    return sorted(addresses, key=lambda address: (-score(key, address), address))


def overload_bound(loads: Mapping[str, float], *, epsilon: float, slack: float) -> float:
    """The load above which a pod counts as overloaded: max((1+ε)·avg, avg + slack)."""
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0; got {epsilon}")
    if slack < 0:
        raise ValueError(f"slack must be >= 0; got {slack}")
    if not loads:
        raise ValueError("overload_bound needs at least one pod load")
    return bound_of_average(sum(loads.values()) / len(loads), epsilon=epsilon, slack=slack)


def bound_of_average(average: float, *, epsilon: float, slack: float) -> float:
    """`overload_bound` for pods whose average load is `average`."""
    return max((1.0 + epsilon) * average, average + slack)


def choose_bounded(
    key: bytes,
    loads: Mapping[str, float],
    *,
    epsilon: float,
    slack: float,
    preferred: str | None = None,
) -> str:
    """Pick a pod for `key` among `loads` (address -> current load) under bounded load.

    `preferred` is the pod the key is already mapped to (a sticky session):
    it is kept while it is a candidate and not overloaded. Otherwise the first
    pod of the key's ranking that is within the bound wins.
    """
    bound = overload_bound(loads, epsilon=epsilon, slack=slack)
    if preferred is not None and preferred in loads and loads[preferred] <= bound:
        return preferred
    return first_ranked(key, [a for a, load in loads.items() if load <= bound])


def first_ranked(key: bytes, addresses: Sequence[str]) -> str:
    """`rank(key, addresses)[0]` without sorting the rest: one hash per pod."""
    if not addresses:
        raise ValueError("first_ranked needs at least one address")
    head = key + SEPARATOR
    digest = xxhash.xxh64_intdigest
    return min(addresses, key=lambda address: (-digest(head + address.encode()), address))


def prefix_key(prompt_token_ids: Sequence[int], num_tokens: int) -> bytes:
    """Affinity key of a prompt: the bytes of its first `num_tokens` token ids.

    Prompts that share their first `num_tokens` tokens (a system prompt, a
    few-shot preamble) get the same key and therefore the same pod, where the
    prefix cache already holds those blocks. Shorter prompts use all their tokens.
    """
    if num_tokens <= 0:
        raise ValueError(f"affinity prefix length must be > 0 tokens; got {num_tokens}")
    head = prompt_token_ids[:num_tokens]
    return b"p:" + struct.pack(f"<{len(head)}i", *head)


def session_key(session_id: str) -> bytes:
    """Affinity key of a session id (namespaced so it never collides with a prefix key)."""
    return b"s:" + session_id.encode()
