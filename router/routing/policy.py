"""RoutingPolicy: which prefill, decode or colocated pod serves a request.

Called by the router server (engineer A) on its asyncio event loop, once per
request (and again, with `exclude`, when a pod refused or failed):

1. `choose_decode(num_tokens=..., prompt_token_ids=...)` — the decode pod
   with room for the request's KV (prompt + max_tokens); among those within
   the load bound, the one whose prefix cache holds the longest prefix of
   the prompt (the index), else the fewest running sequences.
2. `await choose_prefill(session_id=..., prompt_token_ids=...)` — sticky per
   session, else by prefix affinity, both under bounded load.
3. `with policy.track(address, num_tokens=len(prompt)):` around each pod call,
   so the pod's load includes this request the moment it is sent.

Prefill / colocated choice, in order:

* a session id that is mapped (session store) to a healthy, not-overloaded
  pod goes there;
* otherwise the `mode` (`--routing-policy`, router/routing/cache_aware.py)
  places it: by default the key (the session id, or — without a session —
  the first `affinity_tokens` prompt tokens) ranks the pods by rendezvous
  hashing and the first pod within the load bound wins
  (router/routing/rendezvous.py); `cache-aware` weighs each pod's cached
  prefix of the prompt against its load. A session's new pod is written back
  with compare-and-set, so it sticks and all router replicas sharing the
  store agree. (`round-robin` ignores sessions: the A/B baseline.)

Loads: prefill = queued prompt tokens reported by the pod + tokens this
router has queued for it (tokens to compute, router/routing/admission.py)
or in flight there (prompt tokens, from the Prefill call to its first
token) (one request's slack = this prompt's length);
colocated = requests waiting + running on the pod + in flight here (slack = 1
request). Decode pods are ranked by whether they have enough free KV blocks,
then by the prefix of the prompt their prefix cache holds (only pods whose
running + in-flight sequences are within the load bound, slack 1 request,
count theirs), then by running + in-flight sequences, then by free blocks.
A decode pod's cached prefix is a prompt its prefill path need not send
(cache-miss-only transfer) or it need not compute (a local prefill): a
prompt computed on a decode pod keeps its next turn there. With no index,
or no decode pod publishing its cache, the order is least-loaded as before.
No session stickiness for decode pods: the prefix decides.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Iterator, Sequence
from typing import TypeVar

from router.cache_index.index import PrefixIndex, PromptBlocks
from router.routing.base import NoPodAvailable, PodLoad, PodPool
from router.routing.cache_aware import (
    RoundRobin,
    check_load_weight,
    check_routing_policy,
    choose_cache_aware,
)
from router.routing.rendezvous import (
    bound_of_average,
    choose_bounded,
    overload_bound,
    prefix_key,
    session_key,
)
from router.sessions import SessionStore, SessionStoreError

log = logging.getLogger(__name__)

_STORE_WARNING_INTERVAL_S = 10.0  # one log line per interval while the store is down
T = TypeVar("T")


class RoutingPolicy:
    """Chooses pods from a `PodPool`; see the module docstring for the rules."""

    def __init__(
        self,
        pool: PodPool,
        session_store: SessionStore,
        *,
        epsilon: float = 0.25,
        block_size_for_affinity: int = 64,
        mode: str = "first-tokens",
        index: PrefixIndex | None = None,
        cache_load_weight: float = 1.0,
    ) -> None:
        if not 0.0 <= epsilon <= 10.0:
            raise ValueError(f"session epsilon must be in [0, 10]; got {epsilon}")
        if block_size_for_affinity <= 0:
            raise ValueError(
                f"block_size_for_affinity must be > 0 tokens; got {block_size_for_affinity}"
            )
        if check_routing_policy(mode) == "cache-aware" and index is None:
            raise ValueError("the cache-aware routing policy needs a prefix index")
        self.mode = mode
        self.index = index
        self.cache_load_weight = check_load_weight(cache_load_weight)
        self._turns = RoundRobin()
        self.pool = pool
        self.sessions = session_store
        self.epsilon = epsilon
        self.affinity_tokens = block_size_for_affinity
        self._store_warned_at = -_STORE_WARNING_INTERVAL_S
        self.store_cpu_s = 0.0  # thread time spent awaiting the session store, summed

    async def choose_prefill(
        self,
        *,
        session_id: str | None,
        prompt_token_ids: Sequence[int],
        exclude: frozenset[str] = frozenset(),
    ) -> str:
        """Address of the prefill pod for this prompt. Raises NoPodAvailable."""
        pods = self._candidates("prefill", exclude)
        loads = {p.address: float(p.num_waiting_tokens + p.in_flight_tokens) for p in pods}
        slack = float(max(1, len(prompt_token_ids)))
        return await self._choose_sticky("prefill", loads, session_id, prompt_token_ids, slack)

    async def choose_colocated(
        self,
        *,
        session_id: str | None,
        prompt_token_ids: Sequence[int],
        exclude: frozenset[str] = frozenset(),
    ) -> str:
        """Address of the colocated pod for this prompt. Raises NoPodAvailable."""
        pods = self._candidates("colocated", exclude)
        loads = {p.address: float(p.num_waiting + p.num_running + p.in_flight) for p in pods}
        return await self._choose_sticky("colocated", loads, session_id, prompt_token_ids, 1.0)

    def choose_decode(self, *, num_tokens: int, exclude: frozenset[str] = frozenset(),
                      prompt_token_ids: Sequence[int] = ()) -> str:
        """Address of the decode pod for a request whose KV spans `num_tokens`
        (prompt + max_tokens) and whose context is `prompt_token_ids` (empty:
        prefix-blind). Raises NoPodAvailable.

        Pods whose last report shows too few free blocks still qualify when no
        pod has room (the report may be stale; the pod itself answers
        RESOURCE_EXHAUSTED if it really is full), but a request larger than
        every pod's whole cache is refused here.
        """
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be > 0; got {num_tokens}")
        walked, room = self._walk_decode(num_tokens, exclude)
        if room is None:  # nothing fits: the walk left the candidates for this message
            raise self._too_large(num_tokens, self._candidates("decode", exclude))
        holder = self._best_decode_holder(num_tokens, exclude, prompt_token_ids)
        # A pod with room beats one without; among either, a cached prefix beats
        # none (the order of the module docstring). The walk's pod caches none
        # of the prompt, or it would be a holder ranked at least as well.
        if holder is not None and (holder[1] or not room):
            return holder[0]
        return walked.address

    def _walk_decode(self, num_tokens: int, exclude: frozenset[str]
                     ) -> tuple[PodLoad | None, bool | None]:
        """The least-loaded decode pod with room and True, else the least
        loaded that could ever hold the request and False, else (None, None).
        Walks the pool's load order from the least loaded and stops at the
        first with room, so the choice does not grow with the pods."""
        need: dict[int, int] = {}
        first_fitting: PodLoad | None = None
        seen = False
        for pod in self.pool.by_load("decode"):
            if pod.address in exclude:
                continue
            seen = True
            blocks = need.get(pod.block_size)
            if blocks is None:
                blocks = need[pod.block_size] = _blocks_needed(num_tokens, pod.block_size)
            if blocks > pod.num_total_blocks:
                continue
            if blocks <= pod.num_free_blocks:
                return pod, True
            if first_fitting is None:
                first_fitting = pod
        if first_fitting is not None:
            return first_fitting, False
        if not seen:
            self._candidates("decode", exclude)  # raises NoPodAvailable, saying why
        return None, None

    def _best_decode_holder(self, num_tokens: int, exclude: frozenset[str],
                            prompt_token_ids: Sequence[int]) -> tuple[str, bool] | None:
        """The decode pod that caches the longest prefix of the prompt, per
        the index, among those within the load bound (sequences, one request
        of slack: a hot cache never piles requests onto one pod) that could
        hold the request; ties by fewer sequences, then more free blocks.
        With whether it has room now. None when no such pod caches any of
        it. Asks the index only for the pods holding the prompt's first
        block, so a decode pod's cache costs the choice its holders, not a
        ranking of every pod; the bound's average is the one pass."""
        if self.index is None or not prompt_token_ids:
            return None
        decode = self.pool.addresses("decode")
        if decode.isdisjoint(self.index.published()):  # no decode pod publishes (--no-prefix-cache)
            return None
        held = self.index.holders(PromptBlocks(prompt_token_ids), among=decode)
        if not held or held.keys() <= exclude:
            return None
        need: dict[int, int] = {}  # blocks the request needs, per block size
        total = count = 0
        for pod in self._candidates("decode", exclude):
            blocks = need.get(pod.block_size)
            if blocks is None:
                blocks = need[pod.block_size] = _blocks_needed(num_tokens, pod.block_size)
            if blocks <= pod.num_total_blocks:  # the bound is over the pods that could serve it
                total += pod.num_running + pod.in_flight
                count += 1
        if count < 2:
            return None
        bound = bound_of_average(total / count, epsilon=self.epsilon, slack=1.0)
        best: tuple | None = None
        for address, tokens in held.items():
            pod = self.pool.pod("decode", address)
            if tokens <= 0 or pod is None or address in exclude:
                continue
            blocks = need[pod.block_size]
            load = pod.num_running + pod.in_flight
            if blocks > pod.num_total_blocks or load > bound:
                continue
            rank = (blocks > pod.num_free_blocks, -tokens, load, -pod.num_free_blocks, address)
            if best is None or rank < best:
                best = rank
        return None if best is None else (best[-1], not best[0])

    @staticmethod
    def _too_large(num_tokens: int, pods: list[PodLoad]) -> NoPodAvailable:
        largest = max(p.num_total_blocks * p.block_size for p in pods)
        return NoPodAvailable(
            f"request needs KV for {num_tokens} tokens; the largest decode pod holds {largest}"
        )

    @contextlib.contextmanager
    def track(self, address: str, *, num_tokens: int = 0) -> Iterator[None]:
        """Count a request toward `address`'s load while the `with` block runs."""
        with self.pool.track(address, num_tokens=num_tokens):
            yield

    def _candidates(self, role: str, exclude: frozenset[str]) -> list[PodLoad]:
        healthy = self.pool.pods(role)
        pods = [p for p in healthy if p.address not in exclude]
        if not pods:
            known = len(self.pool.known(role))
            detail = f"{known} known, {len(healthy)} healthy"
            if exclude:
                detail += f", {len(exclude & {p.address for p in healthy})} already tried"
            raise NoPodAvailable(f"no healthy {role} pod available ({detail})")
        return pods

    async def _choose_sticky(
        self,
        role: str,
        loads: dict[str, float],
        session_id: str | None,
        prompt_token_ids: Sequence[int],
        slack: float,
    ) -> str:
        if self.mode == "round-robin":
            return self._turns.next(role, list(loads))
        if not session_id:
            return self._place(role, loads, None, prompt_token_ids, slack)
        try:
            mapped = await self._store_call(self.sessions.get(role, session_id))
        except SessionStoreError as exc:
            # Ranking alone still sends the session where its mapping most likely points.
            self._warn_store_down(exc)
            return self._place(role, loads, session_id, prompt_token_ids, slack)
        chosen = self._place(role, loads, session_id, prompt_token_ids, slack, preferred=mapped)
        if chosen == mapped:
            return chosen
        try:
            winner = await self._store_call(self.sessions.assign(role, session_id, mapped,
                                                                 chosen))
        except SessionStoreError as exc:
            self._warn_store_down(exc)
            return chosen
        # Another router replica may have placed the session first; follow it when we can.
        return winner if winner in loads else chosen

    async def _store_call(self, call: Awaitable[T]) -> T:
        """Await a session-store call, adding the thread time it took to
        `store_cpu_s`: other requests' work runs on this thread meanwhile,
        which a decision's CPU time must not count (router/routing/timed.py)."""
        start = time.thread_time()
        try:
            return await call
        finally:
            self.store_cpu_s += time.thread_time() - start

    def _place(self, role: str, loads: dict[str, float], session_id: str | None,
               prompt_token_ids: Sequence[int], slack: float,
               preferred: str | None = None) -> str:
        """`preferred` while within the load bound, else the mode's placement."""
        bound = overload_bound(loads, epsilon=self.epsilon, slack=slack)
        if preferred is not None and preferred in loads and loads[preferred] <= bound:
            return preferred
        if self.mode == "session-sticky" and not session_id:
            return self._turns.least_loaded(role, loads)
        key = (session_key(session_id) if session_id
               else prefix_key(prompt_token_ids, self.affinity_tokens))
        if self.mode == "cache-aware":
            assert self.index is not None
            prompt = PromptBlocks(prompt_token_ids)
            chosen = choose_cache_aware(key, loads, bound, prompt, self.index,
                                        tokens_load=role == "prefill",
                                        load_weight=self.cache_load_weight)
            self.index.expect(chosen, prompt)  # its blocks will be there (index.py)
            return chosen
        return choose_bounded(key, loads, epsilon=self.epsilon, slack=slack)

    def _warn_store_down(self, exc: SessionStoreError) -> None:
        now = time.monotonic()
        if now - self._store_warned_at >= _STORE_WARNING_INTERVAL_S:
            self._store_warned_at = now
            log.warning("routing sessions by hash only: %s", exc)


def _blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / max(1, block_size))

