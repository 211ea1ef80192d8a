"""`DecodeStream`: this router process's one `Decode.Session` stream to one
decode or colocated pod, and `StreamCall`, one request on it (the pod's end
is pod/decode_stream.py; router/sessions.py is session affinity, another
thing).

Why: a Decode.Generate stream per request costs the router one gRPC
message (and poller wake-ups) per token; one stream for all of a pod's
requests carries every request's tokens of an engine step in one
`SessionBatch` (docs/router.md, "Relay").

On the router's event loop:

    open(request)      -> StreamCall registered, `generate` command queued
    reader task        -> per batch, each event to its request's call
                          (tokens with a finish_reason or an error end it)
    StreamCall.read()  -> the next event (`kind` reserved / tokens), or raises
                          the request's error as a `grpc.aio.AioRpcError`
                          with the pod's status code, so a caller handles it
                          exactly like a failed Decode.Generate stream
    StreamCall.cancel  -> `cancel` command (the pod frees the request)
    StreamCall.relay   -> optional: a plain tokens event (no finish) that
                          arrives while the request's task waits in read()
                          with nothing queued goes to this callback instead,
                          which writes it to the client at once (the direct
                          relay, docs/router.md "Relay"); it answers the
                          tokens it wrote, or None to leave the event to read()
    deadline passes    -> the call fails DEADLINE_EXCEEDED and is cancelled
    stream breaks      -> every open call fails with the stream's error
                          (the flow migrates each request); the next open()
                          starts a new stream
    idle IDLE_CLOSE_S  -> the stream is closed: an idle stream would draw
                          keepalive pings the pod's server answers with
                          GOAWAY "too many pings" (router/pod_channels.py)

A pod without `Session` (UNIMPLEMENTED: an older pod during an upgrade)
fails the first call with that code; `PodChannels.open_generate` remembers
the pod and uses `Decode.Generate` for it from then on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc

log = logging.getLogger(__name__)

IDLE_CLOSE_S = 5.0
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StreamCall:
    """One request on a `DecodeStream`, read like a Decode.Generate call:
    `await read()` and `cancel()`. Event loop only."""

    __slots__ = ("request_id", "relay", "_stream", "_events", "_waiter", "_error", "_open",
                 "_timer")

    def __init__(self, stream: DecodeStream, request_id: str) -> None:
        self.request_id = request_id
        # DecodeTokens -> the number of tokens it wrote to the client, or None
        # to leave them to read() (router.flow.pod_caller sets it)
        self.relay: Callable[[pb.DecodeTokens], int | None] | None = None
        self._stream = stream
        self._events: collections.deque[pb.SessionEvent] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: grpc.aio.AioRpcError | None = None
        self._open = True  # the pod still has the request
        self._timer: asyncio.TimerHandle | None = None

    async def read(self) -> pb.SessionEvent | object:
        """The request's next event; `grpc.aio.EOF` after its last one."""
        while not self._events:
            if self._error is not None:
                raise self._error
            if not self._open:
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._events.popleft()

    def cancel(self) -> bool:
        """Tell the pod to drop the request (no-op once it ended); events not
        read yet are dropped, `read()` answers EOF from now on."""
        if not self._open:
            return False
        self._events.clear()
        self._end()
        self._stream.send_cancel(self.request_id)
        return True

    # -- the stream's side

    def put(self, event: pb.SessionEvent) -> int:
        """Take one event from the pod; the number of tokens the direct relay
        wrote of it (0: none, the event is queued for `read()`)."""
        relay, waiter = self.relay, self._waiter
        # The relay's case first, it comes once per token: the task is idle in
        # read(), so every earlier event is written out and writing this one
        # now keeps the client's order.
        if (relay is not None and waiter is not None and not self._events
                and not waiter.done() and event.WhichOneof("kind") == "tokens"):
            tokens = event.tokens
            if not tokens.finish_reason:
                try:
                    written = relay(tokens)
                except Exception:  # a bug here must not break the stream's other requests
                    log.exception("direct relay of %s failed; its task reads from now on",
                                  self.request_id)
                    self.relay = None
                else:
                    if written is not None:
                        return written
        kind = event.WhichOneof("kind")
        if kind == "error":
            self.fail(rpc_error(_CODES.get(event.error.code, grpc.StatusCode.UNKNOWN),
                                event.error.message))
            return 0
        self._events.append(event)
        if kind == "tokens" and event.tokens.finish_reason:
            self._end()
        self._wake()
        return 0

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if self._open:
            self._error = error
            self._end()
            self._wake()

    def set_deadline(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self._open:
            self.fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._stream.send_cancel(self.request_id)

    def _end(self) -> None:
        self._open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stream.forget(self.request_id)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class DecodeStream:
    """One Session stream to `address`; see the module docstring."""

    def __init__(self, address: str, stub: pdserve_pb2_grpc.DecodeStub, *,
                 on_relayed: Callable[[int], None] | None = None) -> None:
        """`on_relayed(n)`: after each batch, the n tokens of it that the
        direct relay wrote (not called when none)."""
        self.address = address
        self._on_relayed = on_relayed
        self._commands: asyncio.Queue[pb.SessionCommand | None] = asyncio.Queue()
        self._calls: dict[str, StreamCall] = {}
        self._call = stub.Session(self._command_stream())
        self._reader = asyncio.create_task(self._read())
        self._idle_timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.heard_from_pod = False  # any batch received on this stream

    @property
    def num_open(self) -> int:
        return len(self._calls)

    def open(self, request: pb.DecodeGenerateRequest, timeout: float) -> StreamCall:
        """Start `request` on the pod; ValueError if its id is open here already."""
        if self.closed:
            raise RuntimeError(f"session to {self.address} is closed")
        rid = request.request_id
        if rid in self._calls:
            raise ValueError(f"request_id {rid!r} is already open on the session to "
                             f"{self.address}")
        call = StreamCall(self, rid)
        call.set_deadline(timeout)
        self._calls[rid] = call
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._commands.put_nowait(pb.SessionCommand(generate=request))
        return call

    def send_cancel(self, request_id: str) -> None:
        if not self.closed:
            self._commands.put_nowait(pb.SessionCommand(cancel=request_id))

    def forget(self, request_id: str) -> None:
        self._calls.pop(request_id, None)
        if not self._calls and not self.closed and self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_later(
                IDLE_CLOSE_S, self._close_idle)

    def _close_idle(self) -> None:
        self._idle_timer = None
        if not self._calls and not self.closed:
            self.closed = True
            self._commands.put_nowait(None)  # half-close: the pod ends the stream

    async def _command_stream(self):
        while True:
            command = await self._commands.get()
            if command is None:
                return
            yield command

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for batch in self._call:
                self.heard_from_pod = True
                calls = self._calls
                relayed = 0
                for event in batch.events:
                    call = calls.get(event.request_id)
                    # else: cancelled here, the pod had it in flight
                    if call is not None:
                        relayed += call.put(event)
                if relayed and self._on_relayed is not None:
                    self._on_relayed(relayed)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE,
                              f"the session to decode pod {self.address} ended")
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the router closed the session")
            raise
        finally:
            self.closed = True
            # ends _command_stream: gRPC's task that feeds it the commands
            # would otherwise wait on the queue until garbage collection
            # destroys it pending (seen when a decode pod is killed)
            self._commands.put_nowait(None)
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            calls, self._calls = list(self._calls.values()), {}
            if calls and error is not None and error.code() != grpc.StatusCode.UNIMPLEMENTED:
                log.warning("session to %s broke with %d request(s) open: %s",
                            self.address, len(calls), error.details())
            for call in calls:
                call.fail(error)

    async def close(self) -> None:
        """Half-close, then end the stream (open requests fail CANCELLED)."""
        self.closed = True
        self._commands.put_nowait(None)
        self._call.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass
