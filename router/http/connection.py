"""Connection timeouts of the router's HTTP server, so no client holds a
connection (a socket, a task) without sending a request.

    connection opens, or a response ends
      │  nothing arrives for keepalive_timeout ─> closed (aiohttp's keep-alive timer)
      v
    first byte of a request line arrives
      │  line + headers not complete header_timeout later ─> closed
      v                                       (`_HeaderTimedHandler`, below)
    the handler runs (the body, the response: the request's own limits)

`TimedAppRunner` is `aiohttp.web.AppRunner` with both: the keep-alive timeout
is aiohttp's `keepalive_timeout`; the header deadline needs a hook aiohttp
does not offer, so its connection handler is subclassed. The subclass reads
two attributes of aiohttp's `RequestHandler` (`_waiter`: set while the
connection waits for a request; `_request_count`: requests whose headers were
parsed); tests/router/http/test_hostile.py fails if an aiohttp upgrade moves them.
Everything here runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler


@dataclass(frozen=True, slots=True)
class HttpTimeouts:
    """`header_timeout`: seconds from a request's first byte to the end of its
    headers. `keepalive_timeout`: seconds an open connection may wait for
    its next request (also its first one)."""

    header_timeout: float = 30.0
    keepalive_timeout: float = 75.0

    def __post_init__(self) -> None:
        for name in ("header_timeout", "keepalive_timeout"):
            value = getattr(self, name)
            if not 0.0 < value <= 3600.0:
                raise ValueError(f"http {name} must be in (0, 3600] seconds, got {value}")


class _HeaderTimedHandler(RequestHandler):
    """aiohttp's connection handler plus the header deadline: armed when the
    first bytes of a request arrive on a connection waiting for one, cancelled
    once that request's headers are parsed; when it fires the connection closes."""

    def __init__(self, manager: web.Server, *, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._header_deadline: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        waiting = self._waiter is not None and not self._waiter.done()
        parsed_before = self._request_count
        super().data_received(data)
        if self._request_count != parsed_before:
            self._cancel_header_deadline()  # a request's headers are complete
        elif waiting and data and self._header_deadline is None:
            self._header_deadline = asyncio.get_running_loop().call_later(
                self._header_timeout, self._header_deadline_passed, parsed_before)

    def _header_deadline_passed(self, parsed_before: int) -> None:
        self._header_deadline = None
        if self._request_count == parsed_before:
            self.force_close()

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)


class _TimedServer(web.Server):
    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout

    def __call__(self) -> RequestHandler:
        return _HeaderTimedHandler(self, loop=self._loop, header_timeout=self._header_timeout,
                                   **self._kwargs)


class TimedAppRunner(web.AppRunner):
    """`web.AppRunner(app, **kwargs)` whose connections follow `timeouts`."""

    def __init__(self, app: web.Application, timeouts: HttpTimeouts, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=timeouts.keepalive_timeout, **kwargs)
        self._timeouts = timeouts

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # the app's startup ran; its handler and kwargs
        return _TimedServer(plain.request_handler, request_factory=plain.request_factory,
                            handler_cancellation=plain.handler_cancellation,
                            loop=asyncio.get_running_loop(),
                            header_timeout=self._timeouts.header_timeout, **plain._kwargs)
