"""The P/D path: one try of a request on a prefill pod and a decode pod.

    disaggregated(): the prefill pod's turn in the router's queue (admission)
                     -> Decode.Generate(remote_prefill=true) -> Reserved{target}
                        (or tokens 0..n: a local rule held on the decode pod,
                        engine/local_rule.py, so it computed the prompt itself)
                     -> Prefill.Prefill(target) on up to 1 + max_prefill_retries
                        prefill pods, until one streams the first token
                     -> the first token, sent at once (before the transfer's verdict)
                     -> tokens 1..n from the decode stream, while the rest of
                        the prefill stream (the verdict) is watched: a failed
                        transfer moves the request with the first token as output

Run by `router.flow.request_flow.RequestFlow` (with the idle side:
`router.flow.local_path.pd_with_idle_side`) over the attempt's `PodCaller`,
on the router's event loop inside `contextlib.aclosing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from proto import pdserve_pb2 as pb
from proto.reasons import SPLIT_HEAD_LOST
from router.api_error import ApiError
from router.flow.output import fold_final, logprobs_from_proto
from router.flow.pod_caller import PodCaller
from router.flow.pod_calls import AttemptFailed, PodFault, describe, pod_fault
from router.flow.state import FlowState
from router.flow.verdict import PrefillEnding, unless_verdict_fails
from router.generation import Delta
from router.routing.admission import AdmissionSlot
from router.routing.base import NoPodAvailable
from router.routing.local_prefill import LocalChoice, QueuedOffer


class IdleSide(Protocol):
    """The idle side as the P/D path sees it while it waits in the prefill
    queue (router/flow/local_path.py builds one)."""

    def offer(self) -> QueuedOffer | None:
        """What the waiting attempt offers decode pods; None: nothing."""

    def take(self, choice: LocalChoice) -> AsyncIterator[Delta]:
        """The attempt on the decode pod `choice` that took it from the queue."""


async def disaggregated(caller: PodCaller, idle_side: IdleSide | None = None
                        ) -> AsyncIterator[Delta]:
    """Wait for a prefill pod's turn (so no reservation waits behind a
    prefill queue), reserve on a decode pod, prefill against the
    reservation, send the first token at once, then stream the decode
    pod's tokens.

    The prefill pod's verdict on the KV transfer comes after its first
    token; until the decode stream shows its first token (the decode pod
    then has the KV, whatever the prefill pod says), a failed verdict ends
    the attempt at once. Every failure after the first token moves the
    request (`migrate=True`) with that token as output: it was sent, and
    an unseeded retry could sample a different one.

    With `idle_side`, a decode pod may take the attempt while it waits in the
    prefill queue (router/routing/local_prefill.py, `QueuedOffer`); the
    attempt then runs where `idle_side.take` sends it."""
    with contextlib.ExitStack() as stack:
        queued = time.monotonic()
        slot = await caller.deps.admission.admit(
            caller.request, exclude=frozenset(caller.left_out), timeout=caller.remaining(),
            local=None if idle_side is None else idle_side.offer())
        if caller.trace is not None:
            caller.trace.timeline.phase("admission_wait", queued, time.monotonic())
        if not isinstance(slot, AdmissionSlot):  # a decode pod took it from the queue
            async with contextlib.aclosing(idle_side.take(slot)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        stack.callback(slot.release)  # a no-op once the prefill released it
        caller.prefill_address = slot.address  # a split keeps that pod's cached prefix whole
        address, call, first, local_asked = await caller.open_stream("decode", stack)
        if (local_asked and first is not grpc.aio.EOF
                and first.WhichOneof("kind") == "tokens"):
            # a local rule held (engine/local_rule.py): the pod's cached prefix
            # left so few new tokens that it computed them itself (no prefill
            # pod, no transfer)
            slot.release()
            caller.to_state(FlowState.LOCAL_PREFILL)
            caller.deps.metrics.local_prefills.inc()
            async with contextlib.aclosing(caller.read_tokens(address, call, first)) as deltas:
                async for delta in deltas:
                    if delta.finish_reason in ("stop", "length"):
                        # the prefill pod keeps the conversation (before the last
                        # delta: a consumer may stop at it and close this generator)
                        _warm(caller, slot.address, answer=False)
                    yield delta
            return
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "reserved":
            raise AttemptFailed(f"decode pod {address} did not answer Reserved first",
                                addresses=frozenset({address}), migrate=True)
        caller.to_state(FlowState.PREFILLING)
        split_at = first.reserved.split_at
        prefill_address, prefill_call, token = await _prefill(
            caller, first.reserved.target, address, stack, slot, split_at)
        ending = PrefillEnding(prefill_call)
        stack.callback(ending.close)
        caller.out.set_cached_tokens(token.num_cached_tokens)
        caller.note(prefill=prefill_address, cached_tokens=token.num_cached_tokens,
                    **({"path": "split", "split_at": split_at} if split_at else {}))
        if split_at:
            # The prefill pod computed the head only: its token is no output.
            # Token 0 comes from the decode pod, once the head is all in.
            caller.deps.metrics.split_prefills.inc()
            caller.to_state(FlowState.DECODING)
        else:
            caller.take_prompt_logprobs(token.prompt_logprobs)
            first_logprobs = ()
            if token.HasField("logprob"):
                first_logprobs = logprobs_from_proto([token.logprob])
            delta = caller.out.accept(caller.out.next_index, [token.token_id], first_logprobs)
            caller.to_state(FlowState.DECODING)
            if caller.out.stopped:  # a stop string ended in the very first token
                call.cancel()
                caller.deps.metrics.aborts.labels(reason="stop_string").inc()
                yield fold_final(delta, caller.finish("stop"))
                return
            if delta is not None:
                yield delta  # the first token goes out before the transfer is decided
        async with contextlib.aclosing(_decode_after_prefill(
                caller, address, call, prefill_address, prefill_call, ending,
                split=bool(split_at))) as deltas:
            async for delta in deltas:
                if delta.finish_reason in ("stop", "length"):
                    _warm(caller, prefill_address, answer=True)
                yield delta


def _warm(caller: PodCaller, prefill_address: str, *, answer: bool) -> None:
    """Have `prefill_address` compute this request's prompt + output in the
    background (router/flow/prefill_warm.py): after a turn the decode pod
    computed (`--local-prefill-warm`), or after a P/D turn's answer when the
    request has a session id (`answer`; `--warm-session-answers`)."""
    rule, warmer = caller.deps.local_prefill, caller.deps.warmer
    if warmer is None or rule is None:
        return
    if answer:
        wanted = rule.settings.warm_answers and bool(caller.request.session_id)
    else:
        wanted = rule.settings.warm
    if wanted:
        warmer.warm(prefill_address, caller.request_id, [
            *caller.request.prompt_token_ids, *caller.out.output_ids])


async def _decode_after_prefill(caller: PodCaller, address: str, call, prefill_address: str,
                                prefill_call: grpc.aio.UnaryStreamCall,
                                ending: PrefillEnding, *, split: bool
                                ) -> AsyncIterator[Delta]:
    """The decode stream once the prefill pod has streamed its first token
    and still owes the transfer's verdict (`unless_verdict_fails`).

    A split (`split`): before token 0 the decode pod fails a split whose
    head's sender went away (`SPLIT_HEAD_LOST`: a split cannot restart).
    That is the head's failure, not the decode pod's, which stays a
    candidate for the next attempt (a broken one was marked unhealthy
    already). A decode pod that refused the head's KV (a bad checksum,
    ...) is left out, as on the whole-prompt path."""
    ending.verdict = verdict = asyncio.ensure_future(
        _transfer_verdict(caller, prefill_address, prefill_call, address))
    relayed = False
    try:
        async with contextlib.aclosing(caller.read_tokens(address, call, None)) as deltas:
            async with contextlib.aclosing(unless_verdict_fails(deltas, verdict)) as relay:
                async for delta in relay:
                    relayed = True
                    ending.finished = delta.finish_reason is not None
                    yield delta
    except AttemptFailed as failure:
        head_lost = split and not relayed and SPLIT_HEAD_LOST in failure.reason
        if not head_lost or address not in failure.addresses:
            raise
        raise AttemptFailed(failure.reason, addresses=failure.addresses - {address},
                            migrate=True) from None


async def _prefill(caller: PodCaller, target: pb.KVTarget, decode_address: str,
                   stack: contextlib.ExitStack, slot: AdmissionSlot, split_at: int = 0,
                   ) -> tuple[str, grpc.aio.UnaryStreamCall, pb.PrefillFirstToken]:
    """Prefill.Prefill against `target`, on up to 1 + max_prefill_retries
    pods (first the one whose turn `slot` holds; the slot is released at
    that pod's first token, when its prefill work is done, or when its
    call fails), until one streams the first token. Returns (address, the call,
    the first token); the call still owes the transfer's verdict (see
    `_transfer_verdict`), and its cancellation is registered on `stack`.

    A prefill pod that is gone or broken (UNAVAILABLE, INTERNAL, UNKNOWN)
    or busy (RESOURCE_EXHAUSTED) before its first token is replaced by
    another against the same reservation: the decode pod's receiver treats
    a sender that went away mid-transfer as lost, not failed, and the new
    pod's BEGIN restarts the transfer from layer 0. Any other failure
    (ABORTED: the decode side refused or failed the transfer,
    DEADLINE_EXCEEDED from the pod, ...) means the reservation itself is
    gone, so the attempt ends and the request starts over on a new pair;
    only the broken pods are left out. After the first token nothing is
    retried against the reservation (see `disaggregated`).

    `split_at` > 0 (the decode pod took a split): the prefill pod computes
    the head, `prompt[:split_at]`, greedy; the token it samples is not the
    request's. A retry here fails at the decode pod (a split cannot
    restart: its tail may have read the layers), so the attempt ends.
    """
    policy, metrics = caller.deps.policy, caller.deps.metrics
    if split_at:
        request = pb.PrefillRequest(
            request_id=caller.request_id,
            prompt_token_ids=caller.request.prompt_token_ids[:split_at],
            sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0),
            target=target,
        )
    else:
        request = pb.PrefillRequest(
            request_id=caller.request_id,
            prompt_token_ids=caller.request.prompt_token_ids,
            sampling=caller.sampling_proto(),
            output_token_ids=caller.out.output_ids,
            target=target,
        )
    tried: set[str] = set(caller.left_out)
    broken: set[str] = set()
    failures: list[str] = []
    for attempt in range(caller.deps.settings.max_prefill_retries + 1):
        try:
            address = slot.address if not attempt else await policy.choose_prefill(
                session_id=caller.request.session_id,
                prompt_token_ids=caller.request.prompt_token_ids,
                exclude=frozenset(tried),
            )
        except NoPodAvailable as exc:
            if not failures:
                raise ApiError(503, exc.reason, code="no_pod_available") from None
            break
        if attempt:
            metrics.retries.labels(role="prefill").inc()
        # the pod's tracked load ends with its prefill work, at the first token
        with policy.track(address, num_tokens=len(request.prompt_token_ids)):
            call = caller.deps.channels.prefill(address).Prefill(
                request, timeout=caller.remaining(), metadata=caller.metadata
            )
            try:
                message = await call.read()
            except grpc.aio.AioRpcError as error:
                caller.pod_failed(error, address)
                message = error
            except BaseException:
                call.cancel()  # we leave early: frees the prefill pod, tells the decode pod
                raise
        # Only the first try runs on the slot's pod; its release counts, and
        # every later one is a no-op.
        if isinstance(message, grpc.aio.AioRpcError):
            slot.release()
            failures.append(f"{address} {describe(message)}")
            caller.event("prefill_failed", pod=address, reason=describe(message))
            tried.add(address)
            fault = pod_fault(message)  # a full pod is skipped, not left out
            if fault is PodFault.BROKEN:
                broken.add(address)
            elif fault is not PodFault.FULL:
                break
            continue
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "first_token":
            call.cancel()  # a pod that breaks the contract counts as broken
            slot.release()
            failures.append(f"{address} did not stream the first token first")
            tried.add(address)
            broken.add(address)
            continue
        # the pod's throughput learns from the tokens it computed
        slot.release(finished_tokens=max(
            1, len(request.prompt_token_ids) - message.first_token.num_cached_tokens))
        return address, call, message.first_token
    raise AttemptFailed(
        f"prefill failed on {len(failures)} pod(s) for decode pod {decode_address}: "
        + "; ".join(failures),
        addresses=frozenset(broken),
        migrate=False,
    )


async def _transfer_verdict(caller: PodCaller, address: str, call: grpc.aio.UnaryStreamCall,
                            decode_address: str) -> None:
    """The rest of the prefill pod's stream after the first token: returns
    once the decode pod accepted the KV; raises AttemptFailed
    (migrate=True, the first token is output now) when the transfer
    failed, leaving out the prefill pod only if it is gone or broken."""
    try:
        message = await call.read()
    except grpc.aio.AioRpcError as error:
        caller.pod_failed(error, address)
        broken = (frozenset({address}) if pod_fault(error) is PodFault.BROKEN
                  else frozenset())
        raise AttemptFailed(
            f"KV transfer from prefill pod {address} to decode pod {decode_address} failed "
            f"after the first token: {describe(error)}",
            addresses=broken, migrate=True) from None
    if message is grpc.aio.EOF or message.WhichOneof("kind") != "transfer_done":
        raise AttemptFailed(
            f"prefill pod {address} ended without the transfer's outcome for decode pod "
            f"{decode_address}", addresses=frozenset({address}), migrate=True)
    caller.note(kv_bytes=message.transfer_done.kv_bytes_sent)
