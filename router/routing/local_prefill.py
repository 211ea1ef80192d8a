"""`LocalPrefill`: when a decode pod prefills a prompt itself (conditional
disaggregation), instead of the P/D path.

Consulted by `router.flow.request_flow` once per attempt, on the router's
event loop, after `choose_path` picked the P/D path. A request goes to a
decode pod with `remote_prefill=false` (the pod computes the prompt in its
own batch, no KV transfer) when every condition holds:

1. the rule is on: `--local-prefill-max-tokens` N > 0;
2. the prompt is short: its new tokens (prompt + output so far, less the
   prefix the decode pod already caches) are at most N;
3. prefill is the bottleneck: the prefill path has at least
   `--local-prefill-queue-ratio` R x the new tokens ahead of this prompt
   (the least over the healthy prefill pods of the prompt tokens this
   router has queued for them or dispatched to them, not yet finished:
   `PrefillAdmission.least_ahead`). The wait at a prefill pod is
   tokens ahead / its prefill rate and the local prefill takes new tokens /
   the decode pod's rate, so with both pods on equal hardware R = 1 means:
   the decode pod finishes the prompt before the prefill pod would even
   start it; and, with `--local-prefill-min-wait` W > 0, those tokens are
   at least W seconds of work at the prefill pod's learnt peak rate (the
   estimate shedding uses; while the rate is unknown, in the pod's first
   prefills, the wait is not known to be long, so nothing goes local), so
   the decode pod's running batch pays for a prompt only when the prompt
   would otherwise wait that long;
4. a decode pod has spare capacity: healthy and not failed for this
   request; no waiting queue in its last report (its scheduler queues what
   it cannot run, so none waiting means it ran fewer than max_num_seqs and
   had blocks; a waiting count that this router's own recent local
   prefills explain does not count: those still computing, and those whose
   first token came back less than `report_age` seconds ago, since the
   report may predate their first step); free KV for prompt + max_tokens;
   and this router's local
   prefills still computing there (sent, first token not back) plus this
   one are at most N tokens, so its running batch stalls for at most one
   N-token prefill at a time. Among such pods: the longest cached prefix
   of the prompt (counted only on pods whose running + in-flight sequences
   are within the load bound, one request of slack: `choose_decode`'s
   rule, so a prompt computed on a pod keeps its next turn there without a
   hot cache piling prefills onto one pod), then the fewest running +
   in-flight sequences, then the most free blocks.

Conditional disaggregation (`--local-prefill-below` T > 0): a prompt with
fewer than T new tokens goes to a decode pod that meets condition 4
whatever the prefill queue (condition 3 is skipped): below the measured
crossover, the decode pod's own prefill is faster than the P/D path's
hops and transfer even with an idle prefill pod. The per-pod budget of
condition 4 is then max(N, T) tokens.

The cached prefix is a hook (`cached_prefix(address, token_ids)`, 0 for
every pod until the router keeps a prefix index): with it, a long prompt
that is mostly cached on a decode pod counts only its uncached tail. The
decode pod itself knows its cache exactly: a request on the P/D path
carries `local_prefill_below(address)` to the decode pod it reserves on
(`DecodeGenerateRequest.local_prefill_below`), which computes the prompt
itself instead of reserving when its cached prefix leaves fewer new tokens
than that (the reservation reply is then tokens, not Reserved).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from router.routing.base import PodLoad, PodPool
from router.routing.ledger import LOCAL_RATE_WINDOW_S as LOCAL_RATE_WINDOW_S  # re-exported
from router.routing.ledger import LocalRate, PodLedger, PodWork
from router.routing.rendezvous import overload_bound
from router.settings import LocalPrefillSettings

# Tokens of `token_ids` decode pod `address` already caches (a prefix).
CachedPrefix = Callable[[str, Sequence[int]], int]


@dataclass(frozen=True, slots=True)
class Ahead:
    """What waits ahead of a prompt on the prefill path: prompt tokens to
    compute, and the seconds they take at the prefill pod's learnt peak rate
    (None while that is unknown)."""

    tokens: int
    wait: float | None = None


# What waits ahead of a new prompt on the prefill path, given the pods to leave out.
LeastAhead = Callable[[frozenset[str]], Ahead]


def no_cached_prefix(address: str, token_ids: Sequence[int]) -> int:
    """The hook until a router-side prefix index exists: nothing is known cached."""
    return 0


@dataclass(frozen=True, slots=True)
class LocalChoice:
    """A decode pod that prefills the request itself, and why."""

    address: str
    new_tokens: int
    tokens_ahead: int  # on the prefill path, when it was chosen (-1: not looked at)


class LocalPrefill:
    """The rule above plus this router's local prefills still computing per
    decode pod; one per router, used on its event loop only."""

    def __init__(self, pool: PodPool, least_ahead: LeastAhead, settings: LocalPrefillSettings,
                 cached_prefix: CachedPrefix = no_cached_prefix,
                 rate: LocalRate | None = None, epsilon: float = 0.25) -> None:
        self._pool = pool
        self.epsilon = epsilon  # the load bound's, as the routing policy's session epsilon
        self.rate = rate or LocalRate()  # every local prefill this rule let start
        self._least_ahead = least_ahead
        self._cached_prefix = cached_prefix
        self.settings = settings
        # per decode pod: this router's local prefills sent, first token not back
        self._computing = PodLedger(on_release=self._released)
        # address -> first-token times of this router's recent local prefills there
        self._released_at: dict[str, collections.deque[float]] = {}
        # resolved when a local prefill's first token frees its pod's budget
        self._room_freed: asyncio.Future[None] | None = None

    def offer_for(self, token_ids: Sequence[int], *, max_context: int,
                  exclude: frozenset[str]) -> QueuedOffer | None:
        """What a request waiting in the prefill queue asks (`QueuedOffer`),
        or None when the queue rule is off (`--local-prefill-max-tokens` 0)."""
        if not self.settings.max_tokens:
            return None
        return QueuedOffer(self, tuple(token_ids), max_context, exclude)

    def room_freed(self) -> asyncio.Future[None]:
        """Resolved the next time a local prefill of this router gets its
        first token (its pod's budget frees). Shared by every waiter."""
        if self._room_freed is None or self._room_freed.done():
            self._room_freed = asyncio.get_running_loop().create_future()
        return self._room_freed

    def choose(self, token_ids: Sequence[int], *, max_context: int,
               exclude: frozenset[str], ahead: Ahead | None = None) -> LocalChoice | None:
        """The decode pod to prefill `token_ids` (prompt + output so far)
        itself, or None for the P/D path. `max_context`: prompt + max_tokens,
        the KV the pod must have room for; `exclude`: pods that failed;
        `ahead`: what waits ahead of this prompt on the prefill path when
        the caller knows it (it waits in the router's queue), else read
        from the admission (condition 3)."""
        settings = self.settings
        if not settings.enabled:
            return None
        if not settings.below:
            # Only condition 3 lets a prompt go local, and a prompt of one new
            # token is the likeliest to pass it: when even that one would
            # wait too little, no pod qualifies (no scan of every decode pod)
            if ahead is None:
                ahead = self._least_ahead(exclude)
            if not self._queue_is_long(ahead, 1):
                return None
        pods = [p for p in self._pool.pods("decode") if p.address not in exclude]
        bound = self._load_bound(pods)
        best: tuple[tuple[int, int, int], LocalChoice] | None = None
        for pod in pods:
            if not self._has_room(pod, max_context):
                continue
            cached = min(len(token_ids), self._cached_prefix(pod.address, token_ids))
            new = len(token_ids) - cached
            if self._tokens_computing(pod.address) + new > settings.budget:
                continue
            if new >= settings.below:  # not below the crossover: only when P is the bottleneck
                if new > settings.max_tokens:
                    continue
                if ahead is None:
                    ahead = self._least_ahead(exclude)
                if not self._queue_is_long(ahead, new):
                    continue
                seen = ahead.tokens
            else:
                seen = -1 if ahead is None else ahead.tokens
            load = pod.num_running + pod.in_flight
            rank = (-cached if load <= bound else 0, load, -pod.num_free_blocks)
            if best is None or rank < best[0]:
                best = (rank, LocalChoice(pod.address, new, seen))
        return None if best is None else best[1]

    def _load_bound(self, pods: list[PodLoad]) -> float:
        """The running + in-flight sequences above which a decode pod's cached
        prefix does not count (`choose_decode`'s bound: one request of slack),
        so a hot cache never piles local prefills onto one pod."""
        if len(pods) < 2:
            return math.inf
        loads = {p.address: float(p.num_running + p.in_flight) for p in pods}
        return overload_bound(loads, epsilon=self.epsilon, slack=1.0)

    def _queue_is_long(self, ahead: Ahead, new_tokens: int) -> bool:
        """Condition 3: prefill is the bottleneck for a prompt of `new_tokens`."""
        settings = self.settings
        if ahead.tokens <= 0 or ahead.tokens < settings.queue_ratio * new_tokens:
            return False
        if not settings.min_wait:
            return True
        return ahead.wait is not None and ahead.wait >= settings.min_wait

    def prefill_cached_at(self, prefill_address: str, token_ids: Sequence[int]) -> int | None:
        """What a request reserving on a decode pod carries as
        `prefill_cached_tokens` (with `local_within_budget`): the prefix of
        `token_ids` that `prefill_address` caches, as this router's index
        knows it (0 before a prefill pod is chosen); None when the rule is
        off (`--no-local-prefill-within-budget`). The decode pod computes
        the prompt itself only when it caches more than that and the rest
        fits its inter-token budget (engine/local_rule.py)."""
        if not self.settings.within_budget:
            return None
        return self._cached_prefix(prefill_address, token_ids) if prefill_address else 0

    def below_at(self, address: str, max_context: int) -> int:
        """What a request reserving on decode pod `address` carries as
        `local_prefill_below`: T, less what this router's local prefills
        computing there leave of the pod's budget (condition 4); 0 when the
        pod has no room for a local prefill (a waiting queue, too few free
        blocks for `max_context` tokens) or T is off."""
        below = self.settings.below
        if not below:
            return 0
        pod = self._pool.pod("decode", address)
        if pod is None or not self._has_room(pod, max_context):
            return 0
        left = self.settings.budget - self._tokens_computing(address)
        return max(0, min(below, left + 1))  # new < result  <=>  new <= left

    @contextlib.contextmanager
    def computing(self, choice: LocalChoice) -> Iterator[Callable[[], None]]:
        """Count `choice`'s prompt as computing on its pod until the returned
        release is called (at the first token) or the block ends."""
        self.rate.took(choice.new_tokens, time.monotonic())
        slot = self._computing.send(choice.address, choice.new_tokens)
        try:
            yield slot.release
        finally:
            slot.release()

    def _released(self, work: PodWork) -> None:
        """A local prefill's first token is in (or it ended): its pod's budget frees."""
        self._released_at.setdefault(work.address, collections.deque()).append(time.monotonic())
        if self._room_freed is not None and not self._room_freed.done():
            self._room_freed.set_result(None)

    def _tokens_computing(self, address: str) -> int:
        work = self._computing.get(address)
        return 0 if work is None else work.tokens

    def _has_room(self, pod: PodLoad, max_context: int) -> bool:
        blocks = math.ceil(max_context / pod.block_size) if pod.block_size else math.inf
        return (pod.num_waiting <= self._explained_waiting(pod.address)
                and pod.num_free_blocks >= blocks)

    def _explained_waiting(self, address: str) -> int:
        """Requests in `address`'s last report that may be this router's own
        local prefills: those computing, and those finished within the
        report's age (the pod queues a new request until its next step)."""
        work = self._computing.get(address)
        count = 0 if work is None else len(work.outstanding)
        released_at = self._released_at.get(address)
        if released_at is None:
            return count
        horizon = time.monotonic() - self.settings.report_age
        while released_at and released_at[0] < horizon:
            released_at.popleft()
        if not released_at:
            del self._released_at[address]
        return count + len(released_at)


class QueuedOffer:
    """The idle side as one request waiting in the router's prefill queue
    sees it (`PrefillAdmission.admit`): arrival is not the only moment a
    decode pod can take a prompt. A waiter asks again whenever a local
    prefill frees its pod's budget (`changed`) and every
    `RECHECK_S` (decode pods' reports change their room), with the tokens
    still ahead of it in the queue (condition 3, counted from where it
    waits); the first waiter a freed budget fits leaves the queue for that
    pod."""

    RECHECK_S = 0.5

    __slots__ = ("_rule", "_token_ids", "_max_context", "_exclude")

    def __init__(self, rule: LocalPrefill, token_ids: tuple[int, ...], max_context: int,
                 exclude: frozenset[str]) -> None:
        self._rule = rule
        self._token_ids = token_ids
        self._max_context = max_context
        self._exclude = exclude

    def offer(self, ahead: Ahead) -> LocalChoice | None:
        """The decode pod that takes the request now, or None (it waits on)."""
        return self._rule.choose(self._token_ids, max_context=self._max_context,
                                 exclude=self._exclude, ahead=ahead)

    def changed(self) -> asyncio.Future[None]:
        return self._rule.room_freed()
