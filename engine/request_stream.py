"""Where the engine loop's outputs go: one `RequestStream` per request, and
the loop thread's `StreamTable` of the open ones.

A stream is created on the servicer's event loop and registered in the table
by the engine-loop thread *before* the engine sees its request, so no output
can be lost. After each step the loop thread hands each request's outputs to
its stream (`StreamTable.dispatch`), which queues them on the servicer's
event loop with one `call_soon_threadsafe` per event loop and step (not one
per request): every reader of the step wakes in the same event-loop pass, so
a servicer that batches per step (the decode pod's Session) sees the whole
step at once, and the pod pays one loop wake-up per step. A stream ends, and leaves the table,
in exactly one of three ways:

    finished output      -> the reader's `async for` ends after it
    abort(R)             -> the reader gets `RequestAborted(reason)`; outputs
                            still queued before the abort are dropped
    loop stopped / died  -> the reader gets `EngineDead`

Threads: `StreamTable` is touched by the engine-loop thread only; a
`RequestStream` is read by one servicer coroutine and fed by the loop thread
through `call_soon_threadsafe` only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from engine.outputs import RequestOutput

log = logging.getLogger(__name__)


class RequestAborted(Exception):
    """Raised by a `RequestStream` whose request was aborted; `reason` is the
    short word the abort was counted under ("client", "deadline", ...)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} aborted ({reason})")
        self.request_id = request_id
        self.reason = reason


class EngineDead(RuntimeError):
    """The engine loop stopped (its `step()` raised, or the pod shut down)."""


class RequestStream:
    """The outputs of one request, read by one servicer coroutine with
    `async for`. Created on the servicer's event loop; the `mark_pushed` / `end` /
    `abort` methods are called by the engine-loop thread (via `StreamTable`)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._closed = False  # loop thread: the last item is queued
        # Set on the event loop when the request is aborted: outputs the engine
        # produced before the abort and still queued are dropped, so a reader
        # sees nothing after the abort it (or anyone) awaited.
        self._aborted: RequestAborted | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def mark_pushed(self, output: RequestOutput) -> None:
        """Loop thread: `output` is on its way (`StreamTable.dispatch` has the
        event loop run `deliver` for it); a finished one closes the stream."""
        if output.finished:
            self._closed = True

    def deliver(self, output: RequestOutput) -> None:
        """Event loop: queue one output whose `mark_pushed` the loop thread ran."""
        self._queue.put_nowait(output)

    def end(self, exc: BaseException) -> None:
        """Loop thread: close the stream with `exc` (EngineDead) after what is queued."""
        self._closed = True
        post(self._loop, self._queue.put_nowait, exc)

    def abort(self, exc: RequestAborted) -> None:
        """Loop thread: close the stream with `exc`, dropping queued outputs
        (nothing happens if the stream already closed)."""
        if self._closed:
            return
        self._closed = True

        def abort() -> None:
            self._aborted = exc
            self._queue.put_nowait(exc)  # wakes a reader blocked on get()

        post(self._loop, abort)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            if self._aborted is not None:
                raise self._aborted
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class StreamTable:
    """The open streams by request id. Engine-loop thread only; a stream
    leaves the table when it closes (finished, aborted, or the loop ends)."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        # Ids aborted in the engine whose "abort" output the next step still
        # reports: it belongs to no stream, even one that reuses the id by then.
        self._aborted_ids: set[str] = set()

    def add(self, stream: RequestStream) -> None:
        """ValueError when the id already has an open stream on this pod."""
        if stream.request_id in self._streams:
            raise ValueError(f"request_id {stream.request_id!r} is already in use on this pod")
        self._streams[stream.request_id] = stream

    def discard(self, stream: RequestStream) -> bool:
        """Undo `add` (the engine refused the request, or its caller is gone);
        no item is queued. Returns whether `stream` was still open here."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            return True
        return False

    def pop(self, request_id: str) -> RequestStream | None:
        """Take R's stream out (R is being aborted): no output reaches it after this."""
        return self._streams.pop(request_id, None)

    def aborted(self, request_id: str) -> None:
        """R was aborted in the engine (after `pop`): drop the "abort" output
        the next step reports for it."""
        self._aborted_ids.add(request_id)

    def dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        """After a step: each output to its request's stream, in one callback
        per event loop (streams of one servicer share its loop)."""
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for output in outputs:
            if output.finish_reason == "abort" and output.request_id in self._aborted_ids:
                self._aborted_ids.discard(output.request_id)
                continue
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted between the step's start and now
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.mark_pushed(output)
            per_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in per_loop.items():
            post(loop, _deliver_all, items)

    def end_all(self, exc: BaseException) -> None:
        """The loop ends: every open stream ends with `exc`."""
        for stream in self._streams.values():
            stream.end(exc)
        self._streams.clear()


def _deliver_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.deliver(output)


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """`loop.call_soon_threadsafe(fn, *args)` from the loop thread. A caller
    whose event loop already closed (its server shut down) is gone; that must
    not kill the engine loop thread."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        log.debug("dropped a result for a closed event loop")
