"""In-process fake pods (grpc.aio servers) for unit tests of the router's
layers above the pods: request flow, HTTP and gRPC front doors.

They speak the real proto (Decode.Generate with Reserved, Prefill.Prefill,
GetLoad, the health service) over real loopback sockets, with a
deterministic "model" instead of an engine: output token i of a prompt is
`expected_token(prompt, i)`, so any pod (or a pod after a migration)
continues a request exactly. The proof that the system works uses real pod
processes (tests/integration/pods.py); these only drive the router's logic,
including failures real pods cannot be made to show on cue.

KV "transfer": the prefill pod sets an asyncio.Event in the shared `Wire`
keyed by request id; the decode pod waits on it (both live in the test's
event loop).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pod.decode_stream import DecodeStreamMux
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from proto.status import ServiceError, grpc_errors

VOCAB = 26  # token t in 1..26 renders as one lowercase letter


def expected_token(prompt: list[int] | tuple[int, ...], index: int) -> int:
    return (sum(prompt) + 3 * index) % VOCAB + 1


def expected_text(prompt, n: int) -> str:
    return "".join(chr(ord("a") + expected_token(prompt, i) - 1) for i in range(n))


class LetterDetokenizer:
    """Token t -> one letter; holds nothing back (the real one may)."""

    def add(self, token_ids) -> str:
        return "".join(chr(ord("a") + t - 1) for t in token_ids)

    def flush(self) -> str:
        return ""


@dataclass
class Wire:
    """The in-process stand-in for the KV transfer between fake pods."""

    delivered: dict[str, asyncio.Event] = field(default_factory=dict)

    def event(self, request_id: str) -> asyncio.Event:
        return self.delivered.setdefault(request_id, asyncio.Event())


@dataclass
class Behaviour:
    """Knobs a test turns to make a pod misbehave."""

    full: bool = False  # Decode.Generate -> RESOURCE_EXHAUSTED
    fail_prefill: bool = False  # Prefill.Prefill -> UNAVAILABLE
    abort_prefill_once: bool = False  # first Prefill.Prefill -> ABORTED (transfer failed)
    transfer_delay: float = 0.0  # prefill: seconds from the first token to the transfer's end
    fail_transfer_once: bool = False  # first Prefill.Prefill: the first token, then ABORTED
    break_after: int | None = None  # decode: abort the stream after this many tokens sent
    repeat: int = 0  # decode: resend this many already-known tokens first (duplicates)
    gap: bool = False  # decode: skip one index
    delay: float = 0.0  # seconds between decode tokens
    cached_tokens: int = 0
    invalid: str | None = None  # answer INVALID_ARGUMENT with this message
    no_reserved: bool = False  # decode: answer remote_prefill with tokens, not Reserved
    waiting_tokens: int = 0  # GetLoad's num_waiting_tokens (steers the prefill policy)
    no_session: bool = False  # decode: answer Decode.Session UNIMPLEMENTED (an older pod)
    session_internal: bool = False  # decode: end every Session at once with INTERNAL


class _RequestContext:
    """What a request on a Session has of a Generate call's context: abort
    (its status becomes the request's error event) and done callbacks."""

    def __init__(self) -> None:
        self._callbacks: list = []

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise ServiceError(code, details)

    def add_done_callback(self, callback) -> None:
        self._callbacks.append(callback)

    def done(self) -> None:
        for callback in self._callbacks:
            callback(self)


class FakePod(pdserve_pb2_grpc.DecodeServicer, pdserve_pb2_grpc.PrefillServicer):
    """One fake pod; `role` is "prefill", "decode" or "colocated"."""

    def __init__(self, role: str, wire: Wire, behaviour: Behaviour | None = None) -> None:
        self.role = role
        self.wire = wire
        self.behaviour = behaviour or Behaviour()
        self.active: set[str] = set()  # request ids with an open stream / call
        self.cancelled: list[str] = []
        self.requests: list[object] = []
        self.sessions = 0  # Decode.Session streams opened
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        self.server = grpc.aio.server()
        if self.role == "prefill":
            pdserve_pb2_grpc.add_PrefillServicer_to_server(self, self.server)
        else:
            pdserve_pb2_grpc.add_DecodeServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    async def GetLoad(self, request, context):
        return pb.LoadReport(role=self.role, generation=1, num_free_blocks=1000,
                             num_total_blocks=1000, block_size=16, model="fake",
                             max_model_len=4096, num_running=len(self.active),
                             num_waiting_tokens=self.behaviour.waiting_tokens)

    async def Abort(self, request, context):
        return pb.AbortResponse(found=request.request_id in self.active)

    async def Prefill(self, request, context):
        self.requests.append(request)
        b = self.behaviour
        if b.invalid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, b.invalid)
        if b.fail_prefill:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill pod is broken")
        if b.abort_prefill_once and len(self.requests) == 1:
            await context.abort(grpc.StatusCode.ABORTED, "KV transfer failed: connection_lost")
        index = len(request.output_token_ids)
        first = expected_token(request.prompt_token_ids, index)
        yield pb.PrefillResponse(request_id=request.request_id, first_token=pb.PrefillFirstToken(
            token_id=first, num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=b.cached_tokens))
        if b.transfer_delay:
            await asyncio.sleep(b.transfer_delay)
        if b.fail_transfer_once and len(self.requests) == 1:
            await context.abort(grpc.StatusCode.ABORTED, "KV transfer failed: connection_lost")
        self.wire.event(request.request_id).set()
        yield pb.PrefillResponse(request_id=request.request_id,
                                 transfer_done=pb.PrefillTransferDone(kv_bytes_sent=64))

    async def Generate(self, request, context):
        self.requests.append(request)
        b = self.behaviour
        if b.invalid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, b.invalid)
        if b.full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks")
        rid = request.request_id
        self.active.add(rid)
        context.add_done_callback(lambda _: self.active.discard(rid))
        try:
            async for message in self._generate(request, context):
                yield message
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise

    async def Session(self, request_iterator, context):
        """The real pods' multiplexing (pod/decode_stream.py) over this fake's Generate."""
        if self.behaviour.no_session:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        if self.behaviour.session_internal:
            await context.abort(grpc.StatusCode.INTERNAL, "Failed \"execute_batch\"")
        self.sessions += 1
        mux = DecodeStreamMux(self._session_generate, grpc_errors)
        async for batch in mux.run(request_iterator):
            yield batch

    async def _session_generate(self, request):
        context = _RequestContext()
        try:
            async for message in self.Generate(request, context):
                yield message
        finally:
            context.done()

    async def _generate(self, request, context):
        b = self.behaviour
        prompt, done = list(request.prompt_token_ids), len(request.output_token_ids)
        max_tokens = request.sampling.max_tokens
        start = done
        if request.remote_prefill and b.no_reserved:
            yield pb.DecodeGenerateResponse(tokens=pb.DecodeTokens(first_index=0, token_ids=[1]))
            return
        if request.remote_prefill:
            yield pb.DecodeGenerateResponse(reserved=pb.Reserved(
                target=pb.KVTarget(endpoints=[self.address], ticket=request.request_id.encode()),
                block_size=16, num_reserved_blocks=4))
            await asyncio.wait_for(self.wire.event(request.request_id).wait(), 10)
            start = done + 1  # the prefill pod produced token `done`
        if b.repeat:
            start = max(0, start - b.repeat)
        sent = 0
        for index in range(start, max_tokens):
            if b.break_after is not None and sent >= b.break_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "decode pod went away")
            if b.gap and index == start + 1:
                continue
            if b.delay:
                await asyncio.sleep(b.delay)
            last = index == max_tokens - 1
            yield pb.DecodeGenerateResponse(tokens=pb.DecodeTokens(
                first_index=index, token_ids=[expected_token(prompt, index)],
                finish_reason="length" if last else "",
                num_prompt_tokens=len(prompt) if index == start else 0,
                num_cached_tokens=b.cached_tokens if index == start else 0))
            sent += 1
        if start >= max_tokens:  # finished on the prefill pod's token
            yield pb.DecodeGenerateResponse(tokens=pb.DecodeTokens(
                first_index=max_tokens, finish_reason="length"))


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""))
        return reply.status
