"""`SseSink`: the direct relay's writer for one streamed HTTP response
(router.flow.direct_relay).

The handler writes the response's first event through aiohttp, which puts
the status line and headers out with it (aiohttp may hold the headers back
until the first body bytes); `open()` then lets the session's reader write
further events itself: each one HTTP/1.1 chunk, framed as aiohttp frames
them, straight to the connection's transport. The handler's own writes
(anything the relay leaves to the task, `[DONE]`, the end of the body) go
through aiohttp and, being on the same transport from the same thread,
stay in order with the relay's.

Only for HTTP/1.1, whose responses the handler sets chunked explicitly; a
socket whose write buffer holds `HIGH_WATER` bytes or more is left to the
handler, whose write waits for it to drain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiohttp import web

from router.http.responses import ResponseShaper

HIGH_WATER = 0x10000  # aiohttp's writer drains above this too


class SseSink:
    """One SSE response's `DeltaSink`."""

    __slots__ = ("_transport", "_shaper", "_open")

    def __init__(self, request: web.BaseRequest, shaper: ResponseShaper) -> None:
        self._transport: asyncio.Transport | None = request.transport
        self._shaper = shaper
        self._open = False

    def open(self) -> None:
        """The handler's own write put the headers out: events may follow."""
        self._open = True

    def ready(self) -> bool:
        transport = self._transport
        return (self._open and transport is not None and not transport.is_closing()
                and transport.get_write_buffer_size() < HIGH_WATER)

    def send_text(self, text: str, token_ids: Sequence[int]) -> None:
        if text:
            event = self._shaper.text_event(text)
            self._transport.write(b"%x\r\n%b\r\n" % (len(event), event))
