"""Exception -> gRPC status code mapping for every server, as explicit tables.

Who uses it: each servicer decorates its RPC methods with a `StatusMap`
(`@grpc_errors` here, `@pod_errors` from pod/errors.py, or a service's own
extension of it). A map is an explicit, immutable table built by whoever owns the
exception types, never a registry filled at import time, so what a server
answers depends only on the map its methods name. The base mapping is the one
docs/architecture.md ("Errors") fixes:

    ServiceError(code, ...)          -> that code (the service chose it)
    the table's types (in order)     -> their code (e.g. capacity -> RESOURCE_EXHAUSTED)
    ValueError and subclasses        -> INVALID_ARGUMENT   (the caller's fault)
    protobuf DecodeError             -> INVALID_ARGUMENT   (a streamed request message
                                        that does not parse surfaces in the servicer)
    anything else                    -> INTERNAL

This module imports nothing of the project (only grpc and protobuf), so the router and
kv_transfer may use it without pulling in the engine.

`asyncio.CancelledError` is never mapped: a cancelled RPC must unwind so the
servicer's `finally` blocks release what the request held.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
StatusTable = Iterable[tuple[type[BaseException], grpc.StatusCode]]


class ServiceError(Exception):
    """An error whose status code the service picked on purpose
    (UNAVAILABLE while draining, ABORTED when a KV transfer failed,
    DEADLINE_EXCEEDED when KV never arrived). `message` is sent to the client
    as the status details, so it must say what happened."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StatusMap:
    """An explicit exception -> status code table; an instance is the decorator
    of a servicer's methods (see module docstring). Immutable: `extended`
    returns a new map."""

    def __init__(self, table: StatusTable = ()) -> None:
        # (exception type, code), checked in order before the ValueError/INTERNAL fallback
        self.table: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = tuple(table)

    def extended(self, table: StatusTable) -> StatusMap:
        """This map with `table`'s entries checked after this map's own."""
        return StatusMap((*self.table, *table))

    def status_for(self, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status code and details message for `exc` (see module docstring)."""
        if isinstance(exc, ServiceError):
            return exc.code, exc.message
        for exc_type, code in self.table:
            if isinstance(exc, exc_type):
                return code, str(exc) or type(exc).__name__
        if isinstance(exc, ValueError):
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc) or type(exc).__name__
        if isinstance(exc, DecodeError):
            return grpc.StatusCode.INVALID_ARGUMENT, f"a request message does not parse: {exc}"
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"

    def __call__(self, method: F) -> F:
        """Decorate an asyncio servicer method (coroutine or async generator) so
        an exception it raises ends the RPC with the mapped status code instead
        of an opaque UNKNOWN. The signature is `(self, request, context)`."""
        return _decorate(method, self.status_for)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str,
                 status_for: Callable[[BaseException], tuple[grpc.StatusCode, str]]) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    else:
        log.info("%s -> %s: %s", method, code.name, message)
    await context.abort(code, message)


def _decorate(method: F,
              status_for: Callable[[BaseException], tuple[grpc.StatusCode, str]]) -> F:
    name = method.__qualname__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                await _abort(context, exc, name, status_for)

        return stream_wrapper  # type: ignore[return-value]

    if not inspect.iscoroutinefunction(method):
        raise TypeError(f"grpc_errors needs an async method, got {name}")

    @functools.wraps(method)
    async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            await _abort(context, exc, name, status_for)

    return unary_wrapper  # type: ignore[return-value]


# The base mapping (ServiceError, ValueError, else INTERNAL) for servers whose
# methods raise no other typed errors, such as the router's gRPC front door.
grpc_errors = StatusMap()
