"""One place that maps exceptions to gRPC status codes, for every server.

Who uses it: the prefill and decode servicers and the router's gRPC front
door decorate each RPC method with `@grpc_errors`; the integration helpers use
`status_for` to predict codes. The mapping is the one docs/architecture.md
("Errors") fixes:

    ServiceError(code, ...)          -> that code (the service chose it)
    ValueError and subclasses        -> INVALID_ARGUMENT   (the caller's fault)
    capacity errors                  -> RESOURCE_EXHAUSTED (no room now; try another pod)
    anything else                    -> INTERNAL

Capacity errors are `engine.errors.CapacityError` and any class registered
with `register_capacity_error` (the decode service registers kv_transfer's
landing-buffer error); other classes get a code with `register_status` (the
services map a stopped engine loop to UNAVAILABLE). So this module never
imports torch-heavy packages: `engine.errors` is plain Python.

`asyncio.CancelledError` is never mapped: a cancelled RPC must unwind so the
servicer's `finally` blocks release what the request held.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from engine.errors import CapacityError

log = logging.getLogger(__name__)

# (exception type, code) checked in order before the ValueError/INTERNAL fallback
_registered: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
]

F = TypeVar("F", bound=Callable[..., Any])


class ServiceError(Exception):
    """An error whose status code the service picked on purpose
    (UNAVAILABLE while draining, ABORTED when a KV transfer failed,
    DEADLINE_EXCEEDED when KV never arrived). `message` is sent to the client
    as the status details, so it must say what happened."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def register_status(exc_type: type[BaseException], code: grpc.StatusCode) -> None:
    """Map `exc_type` (and subclasses) to `code`. Idempotent; called at import
    time by the service modules that meet such errors (this module cannot
    import them: it stays free of torch-heavy packages)."""
    if (exc_type, code) not in _registered:
        _registered.append((exc_type, code))


def register_capacity_error(exc_type: type[BaseException]) -> None:
    """Map `exc_type` (and subclasses) to RESOURCE_EXHAUSTED."""
    register_status(exc_type, grpc.StatusCode.RESOURCE_EXHAUSTED)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details message for `exc` (see module docstring)."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    for exc_type, code in _registered:
        if isinstance(exc, exc_type):
            return code, str(exc) or type(exc).__name__
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc) or type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    else:
        log.info("%s -> %s: %s", method, code.name, message)
    await context.abort(code, message)


def grpc_errors(method: F) -> F:
    """Decorate an asyncio servicer method (coroutine or async generator) so
    an exception it raises ends the RPC with the mapped status code instead of
    an opaque UNKNOWN. The signature is `(self, request, context)`."""
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
                await _abort(context, exc, name)

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
            await _abort(context, exc, name)

    return unary_wrapper  # type: ignore[return-value]
