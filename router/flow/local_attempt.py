"""`LocalAttempt`: one try of a request whose prompt a decode pod computes
itself (conditional disaggregation; the rule is
router.routing.local_prefill).

    local_prefill(): a generate (remote_prefill=false) on the decode pod
                     the rule chose -> tokens 0..n, as `Attempt.colocated()`;
                     refused when the stream opens -> `Attempt.disaggregated()`

A stream that breaks after it opened ends the attempt with `AttemptFailed`
(the decode pod is left out and the request moves), as on any decode pod.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from router.flow.attempt import Attempt
from router.flow.state import FlowState
from router.generation import Delta
from router.routing.local_prefill import LocalChoice, QueuedOffer

log = logging.getLogger(__name__)


class LocalAttempt(Attempt):
    """An `Attempt` that can also run on a decode pod without a prefill pod."""

    def _queued_offer(self) -> QueuedOffer | None:
        rule = self._deps.local_prefill
        if rule is None:
            return None
        return rule.offer_for(
            (*self._request.prompt_token_ids, *self._out.output_ids),
            max_context=len(self._request.prompt_token_ids) + self._request.sampling.max_tokens,
            exclude=frozenset(self._left_out))

    async def _local_instead(self, choice: LocalChoice) -> AsyncIterator[Delta]:
        """`local_prefill` on the decode pod that took this attempt while it
        waited in the prefill queue."""
        self._to_state(FlowState.LOCAL_PREFILL)
        self._deps.metrics.local_prefills_from_queue.inc()
        log.debug("request %s: decode pod %s takes its %d new tokens from the prefill queue "
                  "(%d tokens ahead of it there)", self._request_id, choice.address,
                  choice.new_tokens, choice.tokens_ahead)
        with self._deps.local_prefill.computing(choice) as first_token:
            async with contextlib.aclosing(self.local_prefill(choice.address,
                                                              first_token)) as deltas:
                async for delta in deltas:
                    yield delta

    async def local_prefill(self, address: str,
                            first_token: Callable[[], None]) -> AsyncIterator[Delta]:
        """A generate with remote_prefill=false on decode pod `address` (over
        the router's Session to it, like every decode call): it
        computes the prompt in its own batch, and tokens 0..n stream as in
        `colocated()`; `first_token` is called when the first token is in.
        A pod that refuses or cannot be reached when the stream opens is left
        out of this attempt, which takes the P/D path instead (counted as a
        decode retry)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._deps.policy.track(
                address, num_tokens=len(self._request.prompt_token_ids)))
            try:
                call, first = await self._deps.channels.open_generate(
                    address, self._generate_request(False), self._remaining())
            except grpc.aio.AioRpcError as error:
                self._pod_failed(error, address)  # raises the client's own errors
            else:
                stack.callback(call.cancel)  # no-op once the call has ended
                first_token()
                self._deps.metrics.local_prefills.inc()
                async with contextlib.aclosing(self._read_tokens(address, call, first)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
        self._deps.metrics.retries.labels(role="decode").inc()
        self._left_out = self._left_out | {address}
        self._to_state(FlowState.RESERVING)
        async with contextlib.aclosing(self.disaggregated()) as deltas:
            async for delta in deltas:
                yield delta
