"""`DecodeServicer`: the `pdserve.v1.Decode` service of decode and colocated pods.

Life cycle of one `Generate` stream (request R) with `remote_prefill=true`
(decode pod), on the pod's event loop unless a thread is named:

    RPC ── draining? ──> UNAVAILABLE;  bad ids/lengths/sampling ──> INVALID_ARGUMENT
      v
    engine_loop.reserve_remote(R)     WAITING_FOR_REMOTE_KV: blocks for context +
      │  no room ──> RESOURCE_EXHAUSTED  max_tokens held (the router tries another pod)
      v
    injector.expect(R); receiver.expect(R) -> landing buffer + ticket
      │  landing pool full ──> RESOURCE_EXHAUSTED (blocks released first)
      v
    yield Reserved{target, block_size, num_reserved_blocks}
      v
    WAITING_FOR_KV: receiver threads land each layer; the injector thread writes
      │  it into R's slots while the engine loop keeps stepping the batch
      │  transfer failed ──> ABORTED "<reason>";  deadline ──> DEADLINE_EXCEEDED
      v
    all layers in + END(first token)  -> injector.forget, receiver.release (landing freed)
      v
    engine_loop.commit_remote(R, first)   RUNNING in the batch
      v
    yield DecodeTokens(first_index=1..), the last one with finish_reason

With `remote_prefill=false` (colocated pod, or a decode pod asked to compute
locally): add_request -> WAITING -> RUNNING -> tokens from index 0.

Cancel (client goes away, or `Abort`) in any state: before commit the
transfer is cancelled at the receiver and the injector forgets R *before*
the engine frees R's blocks, so no writer can touch blocks that another
request may get next; after commit the engine aborts R. Landing buffers are
released in every path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from decode_service.injector import KVInjector, TransferFailed
from decode_service.messages import tokens_message
from engine.engine_loop import EngineDead, EngineLoop, RequestAborted, RequestStream
from engine.metrics import PodMetrics
from engine.sampling_params import SamplingParams
from kv_transfer.base import KVReceiver
from kv_transfer.errors import BufferPoolExhausted, reason_code
from pod.drain import DrainGate
from pod.errors import pod_errors
from pod.kv_shape import KVShape
from pod.load import load_report
from pod.messages import ModelLimits, check_request
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.status import ServiceError

log = logging.getLogger(__name__)

# A full landing pool is "no room now", like a full block pool.
decode_errors = pod_errors.extended(((BufferPoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),))

# Past the transfer deadline the receiver's collector fails the transfer
# itself; this slack only covers its sweep interval before we give up locally.
_DEADLINE_SLACK_S = 1.0


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """The decode pod's receive side; None on a colocated pod."""

    receiver: KVReceiver
    injector: KVInjector
    kv_shape: KVShape
    transfer_timeout_s: float


class DecodeServicer(pdserve_pb2_grpc.DecodeServicer):
    """Thin servicer over the engine loop (and, on a decode pod, the KV receiver)."""

    def __init__(self, *, role: str, loop: EngineLoop, metrics: PodMetrics, gate: DrainGate,
                 limits: ModelLimits, model: str, generation: int,
                 remote: RemoteKV | None) -> None:
        self._role = role
        self._loop = loop
        self._metrics = metrics
        self._gate = gate
        self._limits = limits
        self._model = model
        self._generation = generation
        self._remote = remote
        # R -> the future its Generate awaits while WAITING_FOR_KV (Abort fails it)
        self._waiting_kv: dict[str, asyncio.Future[int]] = {}

    @decode_errors
    async def Generate(self, request: pdserve_pb2.DecodeGenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        with self._gate.admit():
            arrived = time.monotonic()
            checked = check_request(request, self._limits)
            params = checked.params
            prompt, outputs = checked.prompt_token_ids, checked.output_token_ids
            if request.remote_prefill:
                if self._remote is None:
                    raise ValueError("remote_prefill=true needs a decode pod; this "
                                     f"{self._role} pod computes prompts locally")
                messages = self._generate_remote(request.request_id, prompt, outputs, params,
                                                 arrived)
            else:
                messages = self._generate_local(request.request_id, prompt, outputs, params,
                                                arrived)
            async for message in messages:
                yield message

    async def _generate_local(self, rid: str, prompt: list[int], outputs: list[int],
                              params: SamplingParams, arrived: float
                              ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        stream = await self._loop.add_request(rid, prompt, params, output_token_ids=outputs)
        async for message in self._stream_tokens(rid, stream, len(outputs), arrived):
            yield message

    async def _stream_tokens(self, rid: str, stream: RequestStream, first_index: int,
                             arrived: float, first_token_at: float | None = None,
                             ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        """Relay R's outputs; on cancel, abort R in the engine (frees its blocks).
        `first_token_at`: when a remote R's first token (from the prefill pod)
        was committed; later gaps count as inter-token latency."""
        index, last = first_index, first_token_at
        finished = False
        try:
            async for output in stream:
                now = time.monotonic()
                if output.new_token_ids:
                    if last is None:
                        self._metrics.time_to_first_token.observe(now - arrived)
                    else:
                        self._metrics.inter_token_latency.observe(now - last)
                    last = now
                finished = output.finished
                if output.new_token_ids or output.finished:
                    yield tokens_message(output, index)
                index += len(output.new_token_ids)
            self._metrics.e2e_request_latency.observe(time.monotonic() - arrived)
        except RequestAborted:
            finished = True
            yield pdserve_pb2.DecodeGenerateResponse(
                tokens=pdserve_pb2.DecodeTokens(first_index=index, finish_reason="abort"))
        except EngineDead as exc:
            finished = True  # nothing left to abort
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"request {rid} lost: {exc}; retry on another pod") from None
        finally:
            if not finished:
                # Client cancel (CancelledError / generator closed) mid-stream.
                await asyncio.shield(self._loop.abort(rid, "client"))

    async def _generate_remote(self, rid: str, prompt: list[int], outputs: list[int],
                               params: SamplingParams, arrived: float
                               ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        remote = self._remote
        assert remote is not None
        reservation, stream = await self._loop.reserve_remote(rid, prompt, params,
                                                              output_token_ids=outputs)
        layout = remote.kv_shape.layout(reservation.num_context_tokens)
        committed = False
        outcome = "client"  # how R ends if it never reaches commit
        try:
            ready = remote.injector.expect(rid, reservation.slot_mapping, layout.num_layers,
                                           layout.total_bytes)
            self._waiting_kv[rid] = ready
            target = remote.receiver.expect(rid, layout, time.time() + remote.transfer_timeout_s)
            yield pdserve_pb2.DecodeGenerateResponse(reserved=pdserve_pb2.Reserved(
                target=pdserve_pb2.KVTarget(
                    endpoints=list(target.endpoints), ticket=target.ticket,
                    transport=target.transport, generation=target.generation,
                    deadline_unix_ms=int(target.deadline * 1000)),
                block_size=reservation.block_size,
                num_reserved_blocks=len(reservation.block_ids)))
            reserved_at = time.monotonic()
            first_token = await self._await_kv(rid, ready, remote)
            # Reserved -> every layer injected and END accepted, as this pod saw it
            self._metrics.kv_transfer_seconds.observe(time.monotonic() - reserved_at)
            await self._release_transfer(rid, remote)
            await self._loop.commit_remote(rid, first_token)
            committed = True
            first_token_at = time.monotonic()
            self._metrics.time_to_first_token.observe(first_token_at - arrived)
        except (TransferFailed, RequestAborted, ServiceError) as exc:
            outcome = "abort_rpc" if isinstance(exc, RequestAborted) else "transfer"
            raise self._transfer_error(rid, exc, remote) from None
        finally:
            self._waiting_kv.pop(rid, None)
            if not committed:
                await asyncio.shield(self._free_uncommitted(rid, remote, outcome))
        async for message in self._stream_tokens(rid, stream, 1 + len(outputs), arrived,
                                                 first_token_at):
            yield message

    async def _await_kv(self, rid: str, ready: asyncio.Future[int], remote: RemoteKV) -> int:
        try:
            return await asyncio.wait_for(asyncio.shield(ready),
                                          remote.transfer_timeout_s + _DEADLINE_SLACK_S)
        except asyncio.TimeoutError:
            reason = f"deadline: no KV within the {remote.transfer_timeout_s:g}s transfer timeout"
            raise TransferFailed(rid, reason) from None

    def _transfer_error(self, rid: str, exc: Exception, remote: RemoteKV) -> ServiceError:
        if isinstance(exc, ServiceError):
            return exc
        if isinstance(exc, RequestAborted):
            return ServiceError(grpc.StatusCode.ABORTED,
                                f"request {rid} was aborted while waiting for its KV "
                                f"({exc.reason})")
        assert isinstance(exc, TransferFailed)
        code = reason_code(exc.reason)
        self._metrics.transfer_failure(code)
        if code == "deadline":
            return ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"KV for request {rid} did not arrive within the "
                                f"{remote.transfer_timeout_s:g}s transfer timeout "
                                f"({exc.reason}); its blocks were freed")
        return ServiceError(grpc.StatusCode.ABORTED,
                            f"KV transfer for request {rid} failed: {exc.reason}")

    async def _release_transfer(self, rid: str, remote: RemoteKV) -> None:
        """R's KV is in the cache: the injector and the landing buffer are done."""
        await remote.injector.forget(rid)
        remote.receiver.release(rid)

    async def _free_uncommitted(self, rid: str, remote: RemoteKV, reason: str) -> None:
        """Order matters: stop the receiver writing, let the injector finish
        with R, release the landing buffer, and only then free R's blocks."""
        remote.receiver.cancel(rid, f"decode request ended before commit ({reason})")
        await remote.injector.forget(rid)
        remote.receiver.release(rid)
        await self._loop.abort(rid, reason)

    @decode_errors
    async def Abort(self, request: pdserve_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pdserve_pb2.AbortResponse:
        rid = request.request_id
        reason = request.reason or "aborted by caller"
        ready = self._waiting_kv.get(rid)
        if ready is not None:
            # R's blocks may still be written by the injector: let its
            # Generate coroutine free them in order (see _free_uncommitted).
            if not ready.done():
                ready.set_exception(RequestAborted(rid, reason))
            return pdserve_pb2.AbortResponse(found=True)
        found = await self._loop.abort(rid, "abort_rpc")
        return pdserve_pb2.AbortResponse(found=found)

    @decode_errors
    async def GetLoad(self, request: pdserve_pb2.LoadRequest,
                      context: grpc.aio.ServicerContext) -> pdserve_pb2.LoadReport:
        return load_report(self._role, self._model, self._generation, self._loop, self._gate)
