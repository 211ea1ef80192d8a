"""`PrefillWarmer`: after a decode pod computed a turn itself, the prefill
pod the turn would have gone to computes it too, in the background, so its
cache keeps the whole conversation (issue 42).

Why: a turn a decode pod computes (a local rule: `--local-prefill-within-
budget`, `--local-prefill-below`, the idle side) is missing from the prefill
pod's cache, and so is the answer the decode pod generated. When a later
turn cannot be computed on the decode pod (too many new tokens for its
budget), the P/D path then computes every turn since the last one the
prefill pod saw, on that turn's time to first token: measured on two cores,
each local turn's gain came back as a slower next turn
(docs/routing.md, "Next turns on the decode pod").

What: once a local turn has ended, its prompt + answer goes to that prefill
pod as Prefill.Prefill with no KV target and one greedy token (the prefill
pod's "prefill only" request: nothing is sent anywhere); the pod computes
only what its cache lacks and keeps the blocks, and its cache events tell
the routers. Low priority by rule, not by queue: a warm-up is sent only
while the pod's last load report shows nothing waiting, one at a time per
pod; the others wait their turn in this router (at most `MAX_PENDING` per
pod, the oldest dropped first) for up to `WAIT_S` seconds of the pod being
busy, then are dropped. A user reads an answer and types the next turn, so
a warm-up that waits for an idle moment usually lands before the next turn
does. Every outcome is counted (done, failed, skipped); failures are
dropped: the warm-up is an optimisation, and the next turn's P/D path is
correct without it.

Used on the router's event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence

import grpc

from proto import pdserve_pb2 as pb
from router.metrics import RouterMetrics
from router.pod_channels import PodChannels
from router.routing.base import PodPool

log = logging.getLogger("pdserve.router")

MAX_PENDING = 4  # warm-ups waiting per prefill pod
WAIT_S = 5.0  # how long a warm-up waits for its pod to be idle
POLL_S = 0.05  # how often it looks


class PrefillWarmer:
    def __init__(self, pool: PodPool, channels: PodChannels, metrics: RouterMetrics,
                 timeout_s: float = 60.0, wait_s: float = WAIT_S) -> None:
        self._pool = pool
        self._channels = channels
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._wait_s = wait_s
        # per prefill pod: warm-ups not yet sent (request id, token ids), and
        # the task that sends them one at a time
        self._pending: dict[str, collections.deque[tuple[str, list[int]]]] = {}
        self._workers: dict[str, asyncio.Task] = {}

    def warm(self, address: str, request_id: str, token_ids: Sequence[int]) -> bool:
        """Queue `token_ids`' warm-up for prefill pod `address`; False (counted
        as skipped) when that is no known prefill pod."""
        if not address or self._pool.pod("prefill", address) is None:
            self._metrics.prefill_warms.labels(outcome="skipped").inc()
            return False
        pending = self._pending.setdefault(address, collections.deque())
        if len(pending) == MAX_PENDING:
            pending.popleft()
            self._metrics.prefill_warms.labels(outcome="skipped").inc()
        pending.append((f"warm-{request_id}", list(token_ids)))
        if address not in self._workers:
            self._workers[address] = asyncio.get_running_loop().create_task(
                self._drain(address))
        return True

    async def _drain(self, address: str) -> None:
        pending = self._pending[address]
        try:
            while pending:
                request_id, token_ids = pending.popleft()
                if not await self._idle(address):
                    self._metrics.prefill_warms.labels(outcome="skipped").inc()
                    continue
                await self._send(address, request_id, token_ids)
        finally:  # with no await since the loop's last look: no warm() comes between
            self._pending.pop(address, None)
            self._workers.pop(address, None)

    async def _idle(self, address: str) -> bool:
        """Whether `address` reports no queue within `wait_s` (False: still
        busy, or gone)."""
        deadline = asyncio.get_running_loop().time() + self._wait_s
        while True:
            pod = self._pool.pod("prefill", address)
            if pod is None:
                return False
            if not pod.num_waiting:
                return True
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(POLL_S)

    async def _send(self, address: str, request_id: str, token_ids: list[int]) -> None:
        request = pb.PrefillRequest(
            request_id=request_id, prompt_token_ids=token_ids,
            sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0))
        try:
            call = self._channels.prefill(address).Prefill(request, timeout=self._timeout_s)
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as error:
            self._metrics.prefill_warms.labels(outcome="failed").inc()
            log.debug("warm-up %s on %s failed: %s", request_id, address, error.code().name)
            return
        self._metrics.prefill_warms.labels(outcome="done").inc()

    async def close(self) -> None:
        """Cancel the warm-ups in flight and drop those waiting (the router
        is stopping)."""
        tasks = list(self._workers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pending.clear()
