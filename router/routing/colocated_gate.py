"""`ColocatedGate`: the `--max-queue-wait` limit in front of colocated pods.

A colocated pod queues what it cannot run in its own scheduler, and the
router sends it each request at once: its chunked prefill interleaves
prompts with the running batch, so a router-side queue (as
`PrefillAdmission` keeps for prefill pods) would only add a hop. Without a
limit, sustained overload grows that queue without bound; the gate applies
the P/D path's limit, with the same estimate:

    estimated wait at colocated pod C
        = max(prompt tokens this router sent C with no first token back yet,
              C's reported waiting prompt tokens)
          / C's learnt prefill rate

(whole prompts: the router learns a colocated pod's cache hit only from its
first token, so a prompt C holds a prefix of counts in full until then).

The rate is `router.routing.ledger.Throughput`: tokens computed (the
prompt less the pod's reported cache hit) per second of time C had prompts
outstanding, as it stands, not its peak (which the P/D path uses): a
colocated pod's prompts share every step with its decodes, so under
overload its batch grows and its prefill rate falls, where a prefill pod's
rises with company. Neither sees a pod at its --max-num-seqs, which
computes no prompt until a sequence ends; there the estimate runs low.
(The measurements: benchmarks/results/history/routing.md, "The router's
queue and shedding".)

An attempt with no output yet whose chosen pod's wait until its prompt is
computed (those ahead and its own tokens, as on the P/D path) is above the
limit goes to the least-waiting other colocated pod within it; where none is
(`PodCaller.open_stream`), the request gets 429 naming the wait, the pod and
the limit, with Retry-After. As on the P/D path, a pod sheds only once its
rate is known (`MIN_SAMPLES` first tokens: its warm-up is in the first ones)
and only while this router has prompts outstanding there: an idle pod takes
every request, whatever its last report (a poll old) still shows queued.
An attempt that carries output (a request moved from a failed pod) is never
shed: its client already has tokens.

Used on the router's event loop only; each router worker keeps its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from router.api_error import ApiError
from router.metrics import RouterMetrics
from router.routing.base import PodPool
from router.routing.ledger import PodLedger, PodWork, ShedLimit, WorkSlot
from router.settings import AdmissionSettings

# One attempt's prompt at a colocated pod until its first token: the
# ledger's one slot type (router/routing/ledger.py); `release(computed_tokens)`
# when the first token is in, `release()` when the attempt ended before, once.
ColocatedSlot = WorkSlot


class ColocatedGate:
    """The colocated pods' wait estimates and the limit; one per router."""

    def __init__(self, pool: PodPool, metrics: RouterMetrics,
                 limit: AdmissionSettings | float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`limit`: the router's admission settings (their `max_queue_wait`),
        or the limit alone, checked by `AdmissionSettings` as --max-queue-wait is."""
        if not isinstance(limit, AdmissionSettings):
            limit = AdmissionSettings(max_queue_wait=limit)
        self._pool = pool
        self._limit = ShedLimit(limit.max_queue_wait, metrics)
        self.max_queue_wait = limit.max_queue_wait
        self._ledger = PodLedger(clock, on_new=self._bind_gauges)

    def estimated_wait(self, address: str) -> float | None:
        """Seconds a prompt sent to `address` now waits before the pod
        computes it (the module docstring); 0 while this router has nothing
        outstanding there, None while the pod's rate is unknown."""
        work = self._ledger.get(address)
        if work is None or not work.outstanding:
            # idle as far as this router knows: the pod's own report may still
            # show a queue it has since computed (reports lag by a poll)
            return 0.0
        load = self._pool.pod("colocated", address)
        ahead = max(work.tokens, 0 if load is None else load.num_waiting_tokens)
        return work.wait(ahead, peak=False)

    def over_limit(self, address: str, num_tokens: int) -> float | None:
        """The estimated wait at `address` until a prompt of `num_tokens` is
        computed there (those ahead and its own, at the same rate: about its
        first token, as the P/D queue sheds) when it is above the limit (the
        request should not go there), else None. A request that would not
        wait is never refused."""
        wait = self.estimated_wait(address)
        if not wait:  # nothing ahead, or the rate unknown
            return None
        wait += self._ledger.pod(address).wait(num_tokens, peak=False)
        return wait if self._limit.exceeded(wait) else None

    def overloaded(self, waits: dict[str, float], num_tokens: int) -> ApiError:
        """The 429 for a request of `num_tokens` every candidate pod refused
        (`waits`: from `over_limit`, each above the limit); counted as shed."""
        address = min(waits, key=waits.__getitem__)
        wait = waits[address]
        return self._limit.refuse(
            wait, f"the estimated wait at colocated pod {address} is {wait:.1f}s until this "
                  f"prompt is computed ({self._ledger.pod(address).tokens} prompt tokens "
                  f"sent there and not yet computed, and its own {num_tokens})")

    def sent(self, address: str, num_tokens: int) -> ColocatedSlot:
        """Count a prompt of `num_tokens` sent to `address` until its slot is released."""
        return self._ledger.send(address, num_tokens)

    def _bind_gauges(self, work: PodWork) -> None:
        """A pod's account opened: the queue gauges the prefill pods have,
        under the colocated pod's label."""
        self._limit.metrics.bind_pod_queue(
            work.address, dispatched=lambda: work.tokens,
            wait=lambda: self.estimated_wait(work.address),
            rate=lambda: work.throughput.tokens_per_s)
