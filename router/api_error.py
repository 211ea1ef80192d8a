"""`ApiError`: a client-visible failure in OpenAI's error shape.

Raised by request parsing (router.http.requests), auth (router.auth) and the
request flow (router.flow); the HTTP layer turns it into
`{"error": {"message", "type", "param", "code"}}` with its status, the gRPC
layer into the matching status code. Only the message is shown to the
client, so it must say what was wrong and what is allowed.
"""

from __future__ import annotations

from typing import Any

import grpc

_GRPC_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "overloaded_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error with an HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status, "internal_error")
        self.retry_after = retry_after  # seconds, sent as the Retry-After header

    def headers(self) -> dict[str, str]:
        """HTTP headers that go with the error (Retry-After when set)."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.INTERNAL)


def bad_request(message: str, param: str | None = None) -> ApiError:
    """400 for a field the client got wrong; `param` names the field."""
    return ApiError(400, message, param=param)
