"""`DecodeStreamMux`: many requests over one `Decode.Session` stream, on the
pod's event loop (the router's end is router/decode_stream.py).

A router process keeps one Session per pod and sends `SessionCommand`s on
it; the pod answers with `SessionBatch`es. Each `generate` command runs the
pod's ordinary per-request generator (the one behind `Decode.Generate`) as
its own task, so a request on a session lives exactly as a Generate stream
does: same admission, reservation, import, engine and cancel paths. What
differs is the transport:

    command generate R   -> task(R): generate(R) messages -> outbox
    command cancel R     -> task(R).cancel(): R's generator unwinds as a
                            cancelled Generate stream does (the engine aborts
                            R; a request still importing frees its transfer
                            before its blocks, KVImport.free)
    task(R) raises       -> SessionEvent(R, error{code, message}) from the
                            pod's status map, as Generate would have ended
    outbox               -> one SessionBatch per event-loop pass: the engine
                            loop delivers a whole step's outputs in one
                            callback (engine/request_stream.py), so every
                            request of the step is in one batch
    router closes / the session breaks
                         -> every open task is cancelled (each R freed)

Request ids are unique within a session while their task runs; a second
`generate` for a running id gets an INVALID_ARGUMENT error event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable

import grpc

from proto import pdserve_pb2 as pb
from proto.status import StatusMap

log = logging.getLogger(__name__)

# One request's generator: DecodeGenerateRequest -> its Generate messages.
Generate = Callable[[pb.DecodeGenerateRequest], AsyncIterator[pb.DecodeGenerateResponse]]


class DecodeStreamMux:
    """One Session stream's requests; see the module docstring. Event loop only."""

    def __init__(self, generate: Generate, errors: StatusMap) -> None:
        self._generate = generate
        self._errors = errors
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._outbox: list[pb.SessionEvent] = []
        self._wake = asyncio.Event()

    async def run(self, commands: AsyncIterable[pb.SessionCommand]
                  ) -> AsyncIterator[pb.SessionBatch]:
        """Serve `commands` until the router half-closes and every request has
        ended (or until the caller stops iterating: every request is cancelled)."""
        reader = asyncio.create_task(self._read(commands))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._outbox:
                    events, self._outbox = self._outbox, []
                    yield pb.SessionBatch(events=events)
                if reader.done():
                    reader.result()  # a broken command stream ends the session with its error
                    if not self._tasks and not self._outbox:
                        return
        finally:
            reader.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            if tasks:
                # each cancelled request frees what it holds before the session is gone
                await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))

    async def _read(self, commands: AsyncIterable[pb.SessionCommand]) -> None:
        try:
            async for command in commands:
                kind = command.WhichOneof("kind")
                if kind == "generate":
                    self._start(command.generate)
                elif kind == "cancel":
                    task = self._tasks.get(command.cancel)
                    if task is not None:
                        task.cancel()
        finally:
            self._wake.set()  # run() sees the reader done

    def _start(self, request: pb.DecodeGenerateRequest) -> None:
        rid = request.request_id
        if rid in self._tasks:
            self._post(pb.SessionEvent(request_id=rid, error=pb.SessionError(
                code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                message=f"request_id {rid!r} is already running on this session")))
            return
        task = asyncio.create_task(self._serve(rid, request))
        self._tasks[rid] = task

    async def _serve(self, rid: str, request: pb.DecodeGenerateRequest) -> None:
        try:
            async for message in self._generate(request):
                kind = message.WhichOneof("kind")
                if kind == "tokens":
                    event = pb.SessionEvent(request_id=rid, tokens=message.tokens)
                else:
                    event = pb.SessionEvent(request_id=rid, reserved=message.reserved)
                self._post(event)
        except asyncio.CancelledError:
            pass  # cancelled by the router (or the session ended): nobody to tell
        except Exception as exc:  # noqa: BLE001 - mapped to a status, as Generate does
            code, message = self._errors.status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("Session request %s failed", rid, exc_info=exc)
            else:
                log.info("Session request %s -> %s: %s", rid, code.name, message)
            self._post(pb.SessionEvent(request_id=rid, error=pb.SessionError(
                code=code.value[0], message=message)))
        finally:
            del self._tasks[rid]
            self._wake.set()

    def _post(self, event: pb.SessionEvent) -> None:
        self._outbox.append(event)
        self._wake.set()
