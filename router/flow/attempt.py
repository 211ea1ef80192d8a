"""`Attempt`: one try of one request on one P/D pair or one colocated pod.

`router.flow.request_flow.RequestFlow` makes one `Attempt` per try, on the
router's event loop, and iterates `colocated()` or `disaggregated()` inside
`contextlib.aclosing`; leaving early cancels the pod calls the attempt has
open. Tokens go into the flow's `OutputAssembler`, state changes to the
flow's `FlowState` through `to_state`.

    colocated():     Decode.Generate(remote_prefill=false) on a colocated pod
                     -> tokens 0..n
    disaggregated(): the prefill pod's turn in the router's queue (admission)
                     -> Decode.Generate(remote_prefill=true) -> Reserved{target}
                        (or tokens 0..n: the decode pod's cached prefix left fewer
                        new tokens than local_prefill_below, so it computed them)
                     -> Prefill.Prefill(target) on up to 1 + max_prefill_retries
                        prefill pods, until one streams the first token
                     -> the first token, sent at once (before the transfer's verdict)
                     -> tokens 1..n from the decode stream, while the rest of
                        the prefill stream (the verdict) is watched: a failed
                        transfer moves the request with the first token as output

Pods that are full or unreachable when the stream opens are skipped here
(counted as retries); a failure that another pair may not have ends the
attempt with `AttemptFailed`, and the flow decides what happens next. An
error the client must see (bad input, no pod, the deadline) is an
`ApiError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc

from proto import pdserve_pb2 as pb
from proto.reasons import SPLIT_HEAD_LOST
from router.api_error import ApiError
from router.decode_stream import StreamCall
from router.flow.deps import FlowDeps
from router.flow.direct_relay import DeltaSink
from router.flow.output import OutputAssembler, OutputGap, fold_final, logprobs_from_proto
from router.flow.pod_calls import AttemptFailed, PodFault, client_error, describe, pod_fault
from router.flow.state import FlowState
from router.flow.verdict import PrefillEnding, unless_verdict_fails
from router.generation import Delta, GenerationRequest
from router.routing.admission import AdmissionSlot
from router.routing.base import NoPodAvailable
from router.routing.local_prefill import LocalChoice, QueuedOffer
from router.sampling import sampling_to_proto


class Attempt:
    """One try of `request` under `request_id` (unique per attempt: the decode
    pod's ticket binds it, and a pod that still holds a failed attempt's
    state never confuses it with the next). `left_out` are pods that failed
    this request already; `deadline` is the request's (time.monotonic).
    `sink`: the client's stream, for the direct relay (router.flow.direct_relay);
    None keeps every delta on the generators."""

    def __init__(
        self,
        request: GenerationRequest,
        request_id: str,
        *,
        deps: FlowDeps,
        out: OutputAssembler,
        left_out: frozenset[str],
        deadline: float,
        to_state: Callable[[FlowState], None],
        sink: DeltaSink | None = None,
    ) -> None:
        self._request = request
        self._sink = sink
        self._request_id = request_id
        self._deps = deps
        self._out = out
        self._left_out = left_out
        self._deadline = deadline
        self._to_state = to_state
        # local_prefill_below of the last generate built: the stream that opened
        self._local_below = 0

    def _remaining(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise ApiError(
                504,
                "the request did not finish within --request-timeout "
                f"{self._deps.settings.request_timeout:g}s",
            )
        return left

    def _pod_failed(self, error: grpc.aio.AioRpcError, address: str) -> None:
        """A pod call failed. Raise the client's error when it is one (bad input,
        the client's own deadline); otherwise mark an unreachable pod so routing
        skips it, and return: the caller retries or moves the request."""
        api_error = client_error(error, address, self._deps.settings.request_timeout)
        # A 504 with time left is the pod's own deadline: another pod may do it.
        if api_error is not None and not (api_error.status == 504
                                          and self._deadline - time.monotonic() > 1.0):
            raise api_error from None
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            self._deps.pool.mark_unhealthy(address, describe(error))

    def _generate_request(self, remote_prefill: bool, address: str = ""
                          ) -> pb.DecodeGenerateRequest:
        rule = self._deps.local_prefill
        below = 0 if rule is None or not remote_prefill else rule.below_at(
            address, len(self._request.prompt_token_ids) + self._request.sampling.max_tokens)
        self._local_below = below
        return pb.DecodeGenerateRequest(
            request_id=self._request_id,
            prompt_token_ids=self._request.prompt_token_ids,
            sampling=self._sampling_proto(),
            output_token_ids=self._out.output_ids,
            remote_prefill=remote_prefill,
            local_prefill_below=below,
            split_at=self._split_at(address) if remote_prefill and not below else 0,
        )

    def _split_at(self, address: str) -> int:
        """The head's length if this request is split across the prefill pod
        and decode pod `address` (router/routing/split_prefill.py), else 0.
        Not a migrated request (its context has output), and not one that
        wants prompt logprobs."""
        rule = self._deps.split
        if (rule is None or self._out.output_ids
                or self._request.sampling.prompt_logprobs is not None):
            return 0
        return rule.split_at(address, len(self._request.prompt_token_ids))

    def _sampling_proto(self) -> pb.SamplingParams:
        """The request's sampling for a pod; without prompt logprobs once an
        earlier pod reported them (a migrated request's next pod)."""
        sampling = sampling_to_proto(self._request.sampling)
        if self._out.has_prompt_logprobs:
            sampling.prompt_logprobs = 0
        return sampling

    def _take_prompt_logprobs(self, entries) -> None:
        """A pod's prompt logprobs (TokenLogprob messages) into the output,
        when the request asked for them."""
        if self._request.sampling.prompt_logprobs is not None:
            self._out.set_prompt_logprobs(logprobs_from_proto(entries))

    async def _open_stream(self, role: str, stack: contextlib.ExitStack):
        """Start the request on the first pod of `role` that takes it (on this
        router's Session to the pod, or Decode.Generate; PodChannels.open_generate).

        Returns (address, call, first message); the pod's load tracking and
        the call's cancellation are registered on `stack`. Pods that are full
        or unreachable are skipped (counted as retries of `role`); when none
        is left, ApiError 503 says why. A colocated pod whose estimated wait
        is above --max-queue-wait is skipped too (router/routing/
        colocated_gate.py), and when every pod left was, ApiError 429."""
        policy = self._deps.policy
        tried: set[str] = set(self._left_out)
        refusals: list[str] = []
        remote = role == "decode"
        num_prompt = len(self._request.prompt_token_ids)
        # the limit binds a request before its first token only
        gate = None if remote or self._out.output_ids else self._deps.colocated_gate
        over: dict[str, float] = {}  # colocated pods skipped for their wait
        while True:
            try:
                if remote:
                    address = policy.choose_decode(
                        num_tokens=num_prompt + self._request.sampling.max_tokens,
                        exclude=frozenset(tried),
                    )
                else:
                    address = await policy.choose_colocated(
                        session_id=self._request.session_id,
                        prompt_token_ids=self._request.prompt_token_ids,
                        exclude=frozenset(tried),
                    )
            except NoPodAvailable as exc:
                if over:
                    raise gate.overloaded(over, num_prompt) from None
                reason = exc.reason + (f"; refused: {'; '.join(refusals)}" if refusals else "")
                raise ApiError(503, reason, code="no_pod_available") from None
            if gate is not None and (wait := gate.over_limit(address, num_prompt)) is not None:
                over[address] = wait
                tried.add(address)
                continue
            with contextlib.ExitStack() as candidate:
                candidate.enter_context(policy.track(address, num_tokens=num_prompt))
                slot = None
                if gate is not None:
                    slot = gate.sent(address, num_prompt)
                    candidate.callback(slot.release)  # a no-op once the first token is in
                try:
                    call, first = await self._deps.channels.open_generate(
                        address, self._generate_request(remote, address), self._remaining())
                except grpc.aio.AioRpcError as error:
                    self._pod_failed(error, address)
                    refusals.append(f"{address} {describe(error)}")
                    self._deps.metrics.retries.labels(role=role).inc()
                    tried.add(address)
                    continue
                if slot is not None and first is not grpc.aio.EOF:
                    slot.release(_computed(first, num_prompt))
                candidate.callback(call.cancel)  # no-op once the request has ended
                stack.enter_context(candidate.pop_all())
                return address, call, first

    async def colocated(self) -> AsyncIterator[Delta]:
        """A generate command (remote_prefill=false) on the colocated pod's
        Session (or Decode.Generate): tokens 0..n."""
        with contextlib.ExitStack() as stack:
            address, call, first = await self._open_stream("colocated", stack)
            async with contextlib.aclosing(self._read_tokens(address, call, first)) as deltas:
                async for delta in deltas:
                    yield delta

    async def disaggregated(self) -> AsyncIterator[Delta]:
        """Wait for a prefill pod's turn (so no reservation waits behind a
        prefill queue), reserve on a decode pod, prefill against the
        reservation, send the first token at once, then stream the decode
        pod's tokens.

        The prefill pod's verdict on the KV transfer comes after its first
        token; until the decode stream shows its first token (the decode pod
        then has the KV, whatever the prefill pod says), a failed verdict ends
        the attempt at once. Every failure after the first token moves the
        request (`migrate=True`) with that token as output: it was sent, and
        an unseeded retry could sample a different one."""
        with contextlib.ExitStack() as stack:
            slot = await self._deps.admission.admit(
                self._request, exclude=frozenset(self._left_out), timeout=self._remaining(),
                local=self._queued_offer())
            if not isinstance(slot, AdmissionSlot):  # a decode pod took it from the queue
                async with contextlib.aclosing(self._local_instead(slot)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            stack.callback(slot.release)  # a no-op once the prefill released it
            address, call, first = await self._open_stream("decode", stack)
            if (self._local_below and first is not grpc.aio.EOF
                    and first.WhichOneof("kind") == "tokens"):
                # local_prefill_below: the pod's cached prefix left so few new
                # tokens that it computed them itself (no prefill pod, no transfer)
                slot.release()
                self._to_state(FlowState.LOCAL_PREFILL)
                self._deps.metrics.local_prefills.inc()
                async with contextlib.aclosing(self._read_tokens(address, call, first)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "reserved":
                raise AttemptFailed(f"decode pod {address} did not answer Reserved first",
                                    addresses=frozenset({address}), migrate=True)
            self._to_state(FlowState.PREFILLING)
            split_at = first.reserved.split_at
            prefill_address, prefill_call, token = await self._prefill(
                first.reserved.target, address, stack, slot, split_at)
            ending = PrefillEnding(prefill_call)
            stack.callback(ending.close)
            self._out.set_cached_tokens(token.num_cached_tokens)
            if split_at:
                # The prefill pod computed the head only: its token is no output.
                # Token 0 comes from the decode pod, once the head is all in.
                self._deps.metrics.split_prefills.inc()
                self._to_state(FlowState.DECODING)
            else:
                self._take_prompt_logprobs(token.prompt_logprobs)
                first_logprobs = ()
                if token.HasField("logprob"):
                    first_logprobs = logprobs_from_proto([token.logprob])
                delta = self._out.accept(self._out.next_index, [token.token_id], first_logprobs)
                self._to_state(FlowState.DECODING)
                if self._out.stopped:  # a stop string ended in the very first token
                    call.cancel()
                    self._deps.metrics.aborts.labels(reason="stop_string").inc()
                    yield fold_final(delta, self._finish("stop"))
                    return
                if delta is not None:
                    yield delta  # the first token goes out before the transfer is decided
            async with contextlib.aclosing(self._decode_after_prefill(
                    address, call, prefill_address, prefill_call, ending,
                    split=bool(split_at))) as deltas:
                async for delta in deltas:
                    yield delta

    async def _decode_after_prefill(self, address: str, call, prefill_address: str,
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
            self._transfer_verdict(prefill_address, prefill_call, address))
        relayed = False
        try:
            async with contextlib.aclosing(self._read_tokens(address, call, None)) as deltas:
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

    async def _prefill(self, target: pb.KVTarget, decode_address: str,
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
        policy, metrics = self._deps.policy, self._deps.metrics
        if split_at:
            request = pb.PrefillRequest(
                request_id=self._request_id,
                prompt_token_ids=self._request.prompt_token_ids[:split_at],
                sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0),
                target=target,
            )
        else:
            request = pb.PrefillRequest(
                request_id=self._request_id,
                prompt_token_ids=self._request.prompt_token_ids,
                sampling=self._sampling_proto(),
                output_token_ids=self._out.output_ids,
                target=target,
            )
        tried: set[str] = set(self._left_out)
        broken: set[str] = set()
        failures: list[str] = []
        for attempt in range(self._deps.settings.max_prefill_retries + 1):
            try:
                address = slot.address if not attempt else await policy.choose_prefill(
                    session_id=self._request.session_id,
                    prompt_token_ids=self._request.prompt_token_ids,
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
                call = self._deps.channels.prefill(address).Prefill(
                    request, timeout=self._remaining()
                )
                try:
                    message = await call.read()
                except grpc.aio.AioRpcError as error:
                    self._pod_failed(error, address)
                    message = error
                except BaseException:
                    call.cancel()  # we leave early: frees the prefill pod, tells the decode pod
                    raise
            # Only the first try runs on the slot's pod; its release counts, and
            # every later one is a no-op.
            if isinstance(message, grpc.aio.AioRpcError):
                slot.release()
                failures.append(f"{address} {describe(message)}")
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

    async def _transfer_verdict(self, address: str, call: grpc.aio.UnaryStreamCall,
                                decode_address: str) -> None:
        """The rest of the prefill pod's stream after the first token: returns
        once the decode pod accepted the KV; raises AttemptFailed
        (migrate=True, the first token is output now) when the transfer
        failed, leaving out the prefill pod only if it is gone or broken."""
        try:
            message = await call.read()
        except grpc.aio.AioRpcError as error:
            self._pod_failed(error, address)
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

    async def _read_tokens(self, address: str, call, first) -> AsyncIterator[Delta]:
        """Stream DecodeTokens from `call` (a StreamCall, or a Decode.Generate
        call: both give messages whose `kind` is "tokens") into the assembler
        until a finish. After the first delta, a StreamCall's plain tokens
        may go to the client by the direct relay instead (`_relay_direct`)."""
        message = first
        relaying = False
        try:
            while True:
                if message is None:
                    try:
                        message = await call.read()
                    except grpc.aio.AioRpcError as error:
                        self._pod_failed(error, address)
                        raise AttemptFailed(
                            f"decode stream from {address} broke: {describe(error)}",
                            addresses=frozenset({address}), migrate=True) from None
                if message is grpc.aio.EOF or message.WhichOneof("kind") != "tokens":
                    raise AttemptFailed(f"decode stream from {address} ended without a finish",
                                        addresses=frozenset({address}), migrate=True)
                tokens, message = message.tokens, None
                if tokens.num_prompt_tokens:
                    self._out.set_cached_tokens(tokens.num_cached_tokens)
                if tokens.prompt_logprobs:
                    self._take_prompt_logprobs(tokens.prompt_logprobs)
                try:
                    # most streams carry no logprobs: skip the per-message conversion then
                    delta = self._out.accept(tokens.first_index, tokens.token_ids,
                                             logprobs_from_proto(tokens.logprobs)
                                             if tokens.logprobs else ())
                except OutputGap as gap:
                    raise AttemptFailed(f"decode pod {address}: {gap}",
                                        addresses=frozenset({address}), migrate=True) from None
                if self._out.stopped:
                    call.cancel()
                    self._deps.metrics.aborts.labels(reason="stop_string").inc()
                    yield fold_final(delta, self._finish("stop"))
                    return
                if tokens.finish_reason == "abort":
                    raise AttemptFailed(f"decode pod {address} aborted the request",
                                        addresses=frozenset({address}), migrate=True)
                if tokens.finish_reason:
                    yield fold_final(delta, self._finish(tokens.finish_reason))
                    return
                if delta is not None:
                    yield delta
                    # the client has it: from here on the reader may write plain deltas
                    if not relaying:
                        relaying = self._start_direct_relay(call)
        finally:
            if relaying:
                call.relay = None

    def _queued_offer(self) -> QueuedOffer | None:
        """What this attempt offers the idle side while it waits in the
        prefill queue; None here: it only waits (`LocalAttempt` offers)."""
        return None

    def _local_instead(self, choice: LocalChoice) -> AsyncIterator[Delta]:
        """The attempt on the decode pod that took it from the queue."""
        raise AssertionError("an attempt that offers nothing is never taken from the queue")

    def _start_direct_relay(self, call) -> bool:
        """Give `call` the relay callback (router.flow.direct_relay): only a
        StreamCall, only with a client sink, and only for plain text: not
        with stop strings (the task ends the request on a match), logprobs
        or prompt logprobs (their deltas carry more than text)."""
        sampling = self._request.sampling
        if (self._sink is None or not isinstance(call, StreamCall) or not self._out.plain
                or sampling.logprobs is not None or sampling.prompt_logprobs is not None):
            return False
        call.relay = self._relay_direct
        return True

    def _relay_direct(self, tokens: pb.DecodeTokens) -> int | None:
        """The relay callback, called by the session's reader while this
        request's task waits in `read()`: the number of `tokens` (no finish
        reason) written to the client here, or None to leave them to the task.

        Runs once per token per stream, so it reads as little as it can:
        `_start_direct_relay` ruled out what makes a delta more than text,
        and the output stays plain (only a request that asked for prompt
        logprobs gets them)."""
        out, sink = self._out, self._sink
        # a repeat or a gap (a pod after a migration) is the task's to sort out
        if tokens.first_index != len(out.output_ids) or not sink.ready():
            return None
        if out.cached_tokens is None and tokens.num_prompt_tokens:
            out.set_cached_tokens(tokens.num_cached_tokens)
        token_ids = tokens.token_ids
        count = len(token_ids)
        if count:
            sink.send_text(out.accept_text(token_ids), token_ids)
        return count

    def _finish(self, finish_reason: str) -> Delta:
        self._to_state(FlowState.FINISHED)
        return self._out.finish(finish_reason)


def _computed(first: pb.DecodeGenerateResponse | pb.SessionEvent, num_prompt: int) -> int:
    """Prompt tokens a colocated pod computed before its `first` message
    (Decode.Generate's or the Session's): the prompt less the cache hit it
    reports (at least one)."""
    if first.WhichOneof("kind") == "tokens" and first.tokens.num_prompt_tokens:
        tokens = first.tokens
        return max(1, tokens.num_prompt_tokens - tokens.num_cached_tokens)
    return max(1, num_prompt)
