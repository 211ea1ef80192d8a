"""`PrefillAdmission`: the router's queue in front of each prefill pod.

A disaggregated attempt reserves KV blocks on a decode pod only when its
prefill is about to start, so a decode reservation (and its transfer
deadline) never waits behind a queue at the prefill pod. The queue lives
here instead, where it can be seen, bounded and measured.

Life of one attempt's admission (all on the router's event loop):

    admit(request)   the policy picks the prefill pod P (load = P's reported
        │            queued tokens + what this router has queued or sent there)
        │ estimated wait at P until its prompt is computed > --max-queue-wait
        │            ──> ApiError 429 (shed)
        v
    QUEUED           per pod, in order of expected finish (below); counts
        │            toward P's routing load
        │ with the idle side on, a decode pod with room takes it ──> the
        │ attempt prefills there instead (LocalChoice; QueuedOffer in
        │ router/routing/local_prefill.py)
        │ P's dispatched tokens + this request's <= P's dispatch budget
        │ (below), or nothing is dispatched at P (a prompt larger than the
        │ budget still runs, alone)
        v
    DISPATCHED       the attempt reserves on a decode pod and calls P's Prefill
        │ slot.release(num_tokens)   P streamed the first token: its throughput learns
        │ slot.release()             the attempt failed or ended early
        v
    (the next waiter at P is dispatched)

The rules, and why (the measurements behind them:
benchmarks/results/history/routing.md, "The router's queue and shedding"):

- Tokens are tokens to compute: the prompt less the prefix the router
  expects P to hold (router/cache_index; the whole prompt without cache
  events). A turn whose history P holds is a few tokens of work: it
  neither fills P's dispatch budget nor counts as a long wait.
- Order: by expected finish were the waiter served alone, its arrival +
  its tokens / P's throughput (FIFO while the throughput is unknown). A
  short request overtakes a longer one only when it would be done first
  anyway, so a long one is overtaken only by requests that arrive within
  its own service time: it cannot starve, and a cached turn does not wait
  behind every long uncached prompt.
- Dispatch budget: --prefill-dispatch-tokens, and behind the oldest
  dispatched prompt (the one P computes) one prompt of any size, or more
  within --prefill-dispatch-seconds of work at P's throughput, or within
  `SHORT_BATCH_TOKENS` whatever the throughput (only that while it is
  unknown, so a burst at start-up does not go out whole). Why: a pod runs
  what it was sent in as few steps as it can, and every prompt of a step
  gets its first token at the step's end; held here, work is ordered by
  expected finish while the next prompt already waits at P. On a GPU the
  token budget binds. `SHORT_BATCH_TOKENS` because a step's fixed cost
  dominates short prompts: the rate learnt from short prompts sent one at
  a time is a fraction of what P does with them in one step.
- Estimated wait at P = (tokens queued here for P ahead of the request +
  max(tokens dispatched to P by this router, P's reported queued tokens)
  + the request's own tokens) / (P's peak prefill throughput + the decode
  pods' local prefill rate / the number of prefill pods). The second term
  is the idle side's share (router/routing/ledger.py, `LocalRate`):
  under overload decode pods compute part of the prompts, so a queue
  empties faster than P alone computes it. The idle side's own gate
  (`least_ahead`) reads P's rate alone: its question is how long P would
  take. The request's own tokens are counted so that the limit bounds
  about what the client sees, its first token, not only its turn.
- Throughput: tokens computed (the prompt less P's reported cache hit) per
  second of time P had work dispatched, exponentially weighted, so it
  follows load within a few requests. Order and budget use it as it
  stands; the wait uses its peak, halving every `PEAK_HALF_LIFE_S`, since
  a queue deep enough to shed for is served in full steps, at the rate P
  shows with company, not that of sparse single prompts.
- Shedding: none at P until `MIN_SAMPLES` of its prefills finished (its
  first ones pay its warm-up: kernel compilation, allocator growth), and
  only a request that would queue: one P has room for now is dispatched
  at once, whatever the estimate.

Leaving the queue early (client gone, request deadline) removes the waiter;
a request whose deadline passes while queued gets 504.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from router.api_error import ApiError
from router.cache_index.index import PromptBlocks
from router.generation import GenerationRequest
from router.metrics import RouterMetrics
from router.routing.base import NoPodAvailable, PodPool
from router.routing.ledger import PodLedger, PodWork, ShedLimit, Throughput, WorkSlot
from router.routing.local_prefill import Ahead, LocalChoice, LocalRate, QueuedOffer
from router.routing.policy import RoutingPolicy
from router.settings import AdmissionSettings

__all__ = ["SHORT_BATCH_TOKENS", "AdmissionSettings", "AdmissionSlot", "PrefillAdmission"]

# Tokens that may wait at a pod behind the prompt it computes whatever its
# learnt rate (the module docstring, Dispatch budget).
SHORT_BATCH_TOKENS = 256

# A dispatched attempt's place at its prefill pod: the ledger's one slot type
# (router/routing/ledger.py); `release(finished_tokens)` at the first token,
# `release()` when the attempt failed or was left, once.
AdmissionSlot = WorkSlot


@dataclass(slots=True)
class _Waiter:
    num_tokens: int
    turn: asyncio.Future[WorkSlot]  # its slot, once dispatched
    key: float  # expected finish if served alone (the module docstring, Order)


@dataclass(slots=True)
class _PodQueue:
    """One prefill pod's queue, and its dispatched work (`work`, in the ledger)."""

    work: PodWork
    waiters: list[_Waiter] = field(default_factory=list)  # by key
    queued_tokens: int = 0

    @property
    def throughput(self) -> Throughput:
        return self.work.throughput

    def key(self, num_tokens: int, now: float) -> float:
        rate = self.work.throughput.tokens_per_s
        return now if rate is None else now + num_tokens / rate


class PrefillAdmission:
    """The per-pod queues; one per router, used on its event loop only."""

    def __init__(self, pool: PodPool, policy: RoutingPolicy, metrics: RouterMetrics,
                 settings: AdmissionSettings, local: LocalRate | None = None) -> None:
        self._pool = pool
        self._local = local or LocalRate()
        self._policy = policy
        self._metrics = metrics
        self.settings = settings
        self._limit = ShedLimit(settings.max_queue_wait, metrics)
        self._queues: dict[str, _PodQueue] = {}
        self._ledger = PodLedger(on_release=lambda work: self._pump(self._queues[work.address]))

    def estimated_wait(self, address: str, num_tokens: int | None = None, *,
                       computed: bool = False) -> float | None:
        """Seconds a request arriving now would wait for its turn at `address`,
        at the pod's peak throughput plus its share of the decode pods' local
        prefill rate (the module docstring, Estimated wait); None while the
        pod's throughput is unknown. With
        `num_tokens` (the request's tokens to compute), 0 when it would not
        queue, and only the waiters ahead of it count; without, the whole
        queue. `computed`: until its own tokens are computed too, at the same
        rate (what shedding reads: about its first token)."""
        queue = self._queues.get(address)
        if queue is None:
            return 0.0
        dispatched = max(queue.work.tokens, self._reported_waiting(address))
        if num_tokens is None:
            ahead = queue.queued_tokens + dispatched
        else:
            key = queue.key(num_tokens, time.monotonic())
            if self._goes_now(queue, key, num_tokens):
                return 0.0
            ahead = sum(w.num_tokens for w in queue.waiters if w.key <= key) + dispatched
            if computed:
                ahead += num_tokens
        if ahead == 0:
            return 0.0
        local = (self._local.tokens_per_s(time.monotonic())
                 / max(1, len(self._pool.pods("prefill"))))
        return queue.work.wait(ahead, peak=True, extra_rate=local)

    def least_ahead(self, exclude: frozenset[str]) -> Ahead:
        """What waits on the healthy prefill pod (not in `exclude`) with the
        fewest prompt tokens this router has queued for or dispatched to it,
        not yet seen finish, and their wait at its peak rate; no tokens
        without a pod. Read by the local-prefill rule
        (router/routing/local_prefill.py). Only this router's own traffic:
        with the pods' reported queues the rule once saw tokens ahead on an
        idle stack, and a false "busy" sends prompts away from an idle pod."""
        least: tuple[int, str] | None = None
        for pod in self._pool.pods("prefill"):
            if pod.address not in exclude:
                queue = self._queues.get(pod.address)
                tokens = 0 if queue is None else queue.queued_tokens + queue.work.tokens
                if least is None or tokens < least[0]:
                    least = (tokens, pod.address)
        if least is None:
            return Ahead(0)
        return self._ahead(least[1], least[0])

    def _ahead(self, address: str, tokens: int) -> Ahead:
        """`tokens` waiting at `address`, and their wait at its peak rate alone
        (what the idle side's gate asks; `estimated_wait` adds the decode
        pods' share)."""
        queue = self._queues.get(address)
        return Ahead(tokens, None if queue is None else queue.work.wait(tokens, peak=True))

    async def admit(self, request: GenerationRequest, *, exclude: frozenset[str],
                    timeout: float, local: QueuedOffer | None = None
                    ) -> AdmissionSlot | LocalChoice:
        """Wait for this request's turn at a prefill pod. ApiError 429 when the
        wait would exceed --max-queue-wait, 503 without a pod, 504 when
        `timeout` (the request's time left) runs out in the queue. With
        `local` (the idle side, router.routing.local_prefill), a decode pod
        may take the request while it waits: its `LocalChoice` is returned
        instead of a slot, and the request has left the queue."""
        hits = self._expected_hits(request, exclude)
        address = await self._choose(request, hits, exclude)
        num_tokens = _to_compute(request, hits.get(address, 0))
        queue = self._queue(address)
        key = queue.key(num_tokens, time.monotonic())
        if self._goes_now(queue, key, num_tokens):
            self._metrics.queue_wait.observe(0.0)
            return queue.work.send(num_tokens)
        waiter = _Waiter(num_tokens, asyncio.get_running_loop().create_future(), key)
        bisect.insort(queue.waiters, waiter, key=_waiter_key)
        queue.queued_tokens += num_tokens
        queued_at = time.monotonic()
        try:
            # a queued request counts toward its pod's routing load until
            # dispatched (from then on the Prefill call's own tracking counts it)
            with self._pool.track(address, num_tokens=num_tokens):
                taken = await self._wait_turn(address, queue, waiter, timeout, local)
        except BaseException as exc:  # timeout, or the client left (cancelled)
            if waiter.turn.done():  # dispatched just as it left: give the turn back
                waiter.turn.result().release()
            else:
                self._leave(queue, waiter)
            if isinstance(exc, TimeoutError):
                raise ApiError(504, f"the request waited {time.monotonic() - queued_at:.1f}s "
                                    f"in the router's queue for prefill pod {address} and did "
                                    "not finish within --request-timeout") from None
            raise
        self._metrics.queue_wait.observe(time.monotonic() - queued_at)
        if taken is not None:
            self._leave(queue, waiter)
            return taken
        return waiter.turn.result()

    async def _wait_turn(self, address: str, queue: _PodQueue, waiter: _Waiter, timeout: float,
                         local: QueuedOffer | None) -> LocalChoice | None:
        """Until `waiter` is dispatched (None) or, with `local`, a decode pod
        takes it (the choice; the waiter is still queued). TimeoutError after
        `timeout` seconds."""
        if local is None:
            await asyncio.wait_for(asyncio.shield(waiter.turn), timeout)
            return None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            await asyncio.wait((waiter.turn, local.changed()), timeout=min(left, local.RECHECK_S),
                               return_when=asyncio.FIRST_COMPLETED)
            if waiter.turn.done():
                return None
            index = queue.waiters.index(waiter)
            ahead = (sum(w.num_tokens for w in queue.waiters[:index])
                     + max(queue.work.tokens, self._reported_waiting(address)))
            choice = local.offer(self._ahead(address, ahead))
            if choice is not None:
                return choice

    def _leave(self, queue: _PodQueue, waiter: _Waiter) -> None:
        """A waiter leaves the queue undispatched; one it held back may go now."""
        waiter.turn.cancel()
        queue.waiters.remove(waiter)
        queue.queued_tokens -= waiter.num_tokens
        self._pump(queue)

    # ------------------------------------------------------------ internals

    def _expected_hits(self, request: GenerationRequest,
                       exclude: frozenset[str]) -> dict[str, int]:
        """Prompt tokens each prefill pod is expected to hold (none without
        cache events). Read before the policy chooses: a cache-aware choice
        records the prompt's blocks on its pod at once (PrefixIndex.expect)."""
        index = self._policy.index
        addresses = [] if index is None else index.addresses()
        if not addresses:
            return {}
        prompt = PromptBlocks(request.prompt_token_ids)
        hits = {a: index.cached_tokens(a, prompt) for a in addresses if a not in exclude}
        return {a: n for a, n in hits.items() if n}

    async def _choose(self, request: GenerationRequest, hits: Mapping[str, int],
                      exclude: frozenset[str]) -> str:
        try:
            address = await self._policy.choose_prefill(
                session_id=request.session_id, prompt_token_ids=request.prompt_token_ids,
                exclude=exclude)
        except NoPodAvailable as exc:
            raise ApiError(503, exc.reason, code="no_pod_available") from None

        def until_computed(pod: str) -> float | None:
            return self.estimated_wait(pod, _to_compute(request, hits.get(pod, 0)),
                                       computed=True)

        wait = until_computed(address)
        if not self._limit.exceeded(wait):
            return address
        # the chosen pod is too far behind: the least-waiting other pod, if any has room
        waits = {p.address: until_computed(p.address)
                 for p in self._pool.pods("prefill") if p.address not in exclude}
        waits[address] = wait
        best = min(waits, key=lambda a: waits[a] if waits[a] is not None else 0.0)
        best_wait = waits[best]
        if not self._limit.exceeded(best_wait):
            return best
        queue, own = self._queues[best], _to_compute(request, hits.get(best, 0))
        raise self._limit.refuse(
            best_wait, f"the prefill queue's estimated wait is {best_wait:.1f}s until this "
                       f"prompt is computed ({len(queue.waiters)} requests, "
                       f"{queue.queued_tokens} tokens to compute queued in the router for "
                       f"prefill pod {best}, and its own {own})")

    def _reported_waiting(self, address: str) -> int:
        pod = self._pool.pod("prefill", address)
        return 0 if pod is None else pod.num_waiting_tokens

    def _goes_now(self, queue: _PodQueue, key: float, num_tokens: int) -> bool:
        """A request with `key` would be dispatched at once: ahead of every
        waiter, and the pod has room."""
        return ((not queue.waiters or key < queue.waiters[0].key)
                and self._has_room(queue.work, num_tokens))

    def _has_room(self, work: PodWork, num_tokens: int) -> bool:
        """Within the token budget and, behind the oldest dispatched prompt
        (the one P computes), one prompt of any size (the next, waiting there
        when the current one ends), or more within the seconds budget of work
        at P's rate (once known) or within `SHORT_BATCH_TOKENS`."""
        tokens, seconds = self.settings.dispatch_tokens, self.settings.dispatch_seconds
        if tokens == 0 or not work.outstanding:
            return True
        if work.tokens + num_tokens > tokens:
            return False
        if seconds == 0 or len(work.outstanding) < 2:
            return True
        rate = work.throughput.tokens_per_s
        allowed = SHORT_BATCH_TOKENS if rate is None else max(SHORT_BATCH_TOKENS, rate * seconds)
        return work.tokens - work.oldest_tokens + num_tokens <= allowed

    def _pump(self, queue: _PodQueue) -> None:
        """Dispatch waiters in key order while the pod has room."""
        while queue.waiters and self._has_room(queue.work, queue.waiters[0].num_tokens):
            waiter = queue.waiters.pop(0)
            queue.queued_tokens -= waiter.num_tokens
            waiter.turn.set_result(queue.work.send(waiter.num_tokens))

    def _queue(self, address: str) -> _PodQueue:
        """`address`'s queue; the first time, its gauges are bound to it (read
        when /metrics is rendered, on this event loop; NaN while unknown)."""
        queue = self._queues.get(address)
        if queue is None:
            queue = self._queues[address] = _PodQueue(self._ledger.pod(address))
            m = self._metrics
            m.queue_requests.labels(pod=address).set_function(lambda: len(queue.waiters))
            m.queue_tokens.labels(pod=address).set_function(lambda: queue.queued_tokens)
            m.bind_pod_queue(address, dispatched=lambda: queue.work.tokens,
                             wait=lambda: self.estimated_wait(address),
                             rate=lambda: queue.throughput.tokens_per_s)
        return queue


def _to_compute(request: GenerationRequest, cached_tokens: int) -> int:
    """Prompt tokens a prefill pod computes when it holds `cached_tokens` (at least one:
    the prompt's last token always runs)."""
    return max(1, len(request.prompt_token_ids) - cached_tokens)


def _waiter_key(waiter: _Waiter) -> float:
    return waiter.key
