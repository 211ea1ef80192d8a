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
the routers. Low priority by rule, not by queue: only while the pod's last
load report shows nothing waiting and no other warm-up of this router is in
flight there, so it never queues ahead of a request; skipped otherwise
(counted). Failures are counted and dropped: the warm-up is an
optimisation, and the next turn's P/D path is correct without it.

Used on the router's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from proto import pdserve_pb2 as pb
from router.metrics import RouterMetrics
from router.pod_channels import PodChannels
from router.routing.base import PodPool

log = logging.getLogger("pdserve.router")


class PrefillWarmer:
    def __init__(self, pool: PodPool, channels: PodChannels, metrics: RouterMetrics,
                 timeout_s: float = 60.0) -> None:
        self._pool = pool
        self._channels = channels
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._tasks: dict[str, asyncio.Task] = {}  # prefill pod -> its warm-up in flight

    def warm(self, address: str, request_id: str, token_ids: Sequence[int]) -> bool:
        """Start `token_ids`' warm-up on prefill pod `address` when it is idle
        (no queue in its last report, none of ours in flight); False when
        skipped."""
        pod = self._pool.pod("prefill", address) if address else None
        if pod is None or pod.num_waiting or address in self._tasks:
            self._metrics.prefill_warms.labels(outcome="skipped").inc()
            return False
        task = asyncio.get_running_loop().create_task(
            self._run(address, f"warm-{request_id}", list(token_ids)))
        self._tasks[address] = task
        task.add_done_callback(lambda _: self._tasks.pop(address, None))
        return True

    async def _run(self, address: str, request_id: str, token_ids: list[int]) -> None:
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
        """Cancel the warm-ups in flight (the router is stopping)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
