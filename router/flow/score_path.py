"""The scoring path: one try of a request that only scores its prompt
(`max_tokens` 0: OpenAI `echo` / lm-evaluation-harness log-likelihoods).

    scored(): the prefill pod's turn in the router's queue (admission)
              -> Prefill.Prefill without a KV target (no decode pod, no
                 reservation, no transfer) -> `first_token` with
                 `scored_only` and the prompt logprobs -> `transfer_done`
              -> the final delta ("length", no output token)

Colocated pods (and decode pods that compute a prompt themselves) need no
special path: `Decode.Generate(remote_prefill=false)` with max_tokens 0
answers one `DecodeTokens` with the finish and the prompt logprobs.

A prefill pod that fails ends the attempt with `AttemptFailed`
(migrate=False): nothing was sent to the client yet, so the flow starts
the request over, leaving a broken or busy pod out. Run by
`router.flow.request_flow.RequestFlow` over the attempt's `PodCaller`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from proto import pdserve_pb2 as pb
from router.flow.output import logprobs_from_proto
from router.flow.pod_caller import PodCaller
from router.flow.pod_calls import AttemptFailed, describe, pod_fault
from router.generation import Delta


async def scored(caller: PodCaller) -> AsyncIterator[Delta]:
    """Score the prompt on a prefill pod; yields the one final delta."""
    request = caller.request
    assert request.sampling.max_tokens == 0, "only a max_tokens 0 request is scored"
    num_tokens = len(request.prompt_token_ids)
    with contextlib.ExitStack() as stack:
        slot = await caller.deps.admission.admit(
            request, exclude=frozenset(caller.left_out), timeout=caller.remaining())
        stack.callback(slot.release)  # a no-op once released below
        address = slot.address
        caller.note(prefill=address)
        message = pb.PrefillRequest(request_id=caller.request_id,
                                    prompt_token_ids=request.prompt_token_ids,
                                    sampling=caller.sampling_proto())
        with caller.deps.policy.track(address, num_tokens=num_tokens):
            call = caller.deps.channels.prefill(address).Prefill(
                message, timeout=caller.remaining(), metadata=caller.metadata)
            stack.callback(call.cancel)  # no-op once the call has ended
            try:
                first = await call.read()
                done = await call.read() if first is not grpc.aio.EOF else first
            except grpc.aio.AioRpcError as error:
                caller.pod_failed(error, address)  # raises the client's own errors
                # broken or full: the attempt ends here (pod_calls.POD_FAULTS)
                left_out = frozenset({address}) if pod_fault(error) else frozenset()
                raise AttemptFailed(f"scoring on prefill pod {address} failed: "
                                    f"{describe(error)}", addresses=left_out,
                                    migrate=False) from None
        if (first is grpc.aio.EOF or first.WhichOneof("kind") != "first_token"
                or not first.first_token.scored_only or done is grpc.aio.EOF):
            raise AttemptFailed(f"prefill pod {address} did not answer a scored prompt",
                                addresses=frozenset({address}), migrate=False)
        scored = first.first_token
        slot.release(finished_tokens=max(1, num_tokens - scored.num_cached_tokens))
        caller.out.set_cached_tokens(scored.num_cached_tokens)
        if request.sampling.prompt_logprobs is not None:
            caller.out.set_prompt_logprobs(logprobs_from_proto(scored.prompt_logprobs))
        yield caller.finish("length")
