"""The local path: one try of a request whose prompt a decode pod computes
itself (conditional disaggregation; the rule is router.routing.local_prefill).

    local_prefill(): a generate (remote_prefill=false) on the decode pod
                     the rule chose -> tokens 0..n, as on a colocated pod;
                     refused when the stream opens -> the P/D path
    pd_with_idle_side(): the P/D path, offering the attempt to decode pods
                     while it waits in the prefill queue; one that takes it
                     runs `local_prefill` there (`from_queue`)

A stream that breaks after it opened ends the attempt with `AttemptFailed`
(the decode pod is left out and the request moves), as on any decode pod.
Run by `router.flow.request_flow.RequestFlow` over the attempt's `PodCaller`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from router.flow import pd_path
from router.flow.pod_caller import PodCaller
from router.flow.state import FlowState
from router.generation import Delta
from router.routing.local_prefill import LocalChoice, QueuedOffer

log = logging.getLogger(__name__)


class _IdleSide:
    """`pd_path.IdleSide` for one attempt: the local-prefill rule's offer,
    and `from_queue` when a decode pod takes it."""

    __slots__ = ("_caller",)

    def __init__(self, caller: PodCaller) -> None:
        self._caller = caller

    def offer(self) -> QueuedOffer | None:
        caller = self._caller
        rule = caller.deps.local_prefill
        if rule is None:
            return None
        return rule.offer_for(
            (*caller.request.prompt_token_ids, *caller.out.output_ids),
            max_context=len(caller.request.prompt_token_ids) + caller.request.sampling.max_tokens,
            exclude=frozenset(caller.left_out))

    def take(self, choice: LocalChoice) -> AsyncIterator[Delta]:
        return from_queue(self._caller, choice)


def pd_with_idle_side(caller: PodCaller) -> AsyncIterator[Delta]:
    """The P/D path, where a decode pod with room may take the attempt from
    the prefill queue (router/routing/local_prefill.py, `QueuedOffer`)."""
    return pd_path.disaggregated(caller, _IdleSide(caller))


async def from_queue(caller: PodCaller, choice: LocalChoice) -> AsyncIterator[Delta]:
    """`local_prefill` on the decode pod that took this attempt while it
    waited in the prefill queue."""
    caller.to_state(FlowState.LOCAL_PREFILL)
    deps = caller.deps
    deps.metrics.local_prefills_from_queue.inc()
    log.debug("request %s: decode pod %s takes its %d new tokens from the prefill queue "
              "(%d tokens ahead of it there)", caller.request_id, choice.address,
              choice.new_tokens, choice.tokens_ahead)
    with deps.local_prefill.computing(choice) as first_token:
        async with contextlib.aclosing(local_prefill(caller, choice.address,
                                                     first_token)) as deltas:
            async for delta in deltas:
                yield delta


async def local_prefill(caller: PodCaller, address: str,
                        first_token: Callable[[], None]) -> AsyncIterator[Delta]:
    """A generate with remote_prefill=false on decode pod `address` (over
    the router's Session to it, like every decode call): it computes the
    prompt in its own batch, and tokens 0..n stream as on a colocated pod;
    `first_token` is called when the first token is in. A pod that refuses
    or cannot be reached when the stream opens is left out of this attempt,
    which takes the P/D path instead (counted as a decode retry)."""
    deps = caller.deps
    with contextlib.ExitStack() as stack:
        stack.enter_context(deps.policy.track(
            address, num_tokens=len(caller.request.prompt_token_ids)))
        try:
            call, first = await deps.channels.open_generate(
                address, caller.generate_request(False), caller.remaining())
        except grpc.aio.AioRpcError as error:
            caller.pod_failed(error, address)  # raises the client's own errors
        else:
            stack.callback(call.cancel)  # no-op once the call has ended
            first_token()
            deps.metrics.local_prefills.inc()
            async with contextlib.aclosing(caller.read_tokens(address, call, first)) as deltas:
                async for delta in deltas:
                    yield delta
            return
    deps.metrics.retries.labels(role="decode").inc()
    caller.leave_out(address)
    caller.to_state(FlowState.RESERVING)
    async with contextlib.aclosing(pd_with_idle_side(caller)) as deltas:
        async for delta in deltas:
            yield delta
