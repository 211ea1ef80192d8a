"""The router's public gRPC API: `pdserve.v1.Router` (Generate, ListModels)
plus the standard health service.

A thin servicer over the same `Frontend` the HTTP API uses, on the same
event loop: `Generate` turns the `GenerateRequest` into a `ParsedRequest`
(sampling through router.sampling, prompt or messages through
router.http.requests, so both front doors accept and refuse exactly the
same requests; a field this server's proto does not define, which protobuf
would drop in silence, is refused like an unknown JSON field), tokenizes
once and streams one
`GenerateResponse` per delta; the last carries `finish_reason` and `usage`.
Errors leave through `proto.status.grpc_errors`: an `ApiError` becomes its
matching code (400 → INVALID_ARGUMENT, 404 → NOT_FOUND, 503 → UNAVAILABLE,
401 → UNAUTHENTICATED). A cancelled call closes the flow, which cancels its
pod calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from proto.limits import GRPC_MESSAGE_OPTIONS
from proto.status import ServiceError, grpc_errors
from proto.tls import TlsFiles, add_port
from router.api_error import ApiError, bad_request
from router.auth import ApiKeyCheck
from router.client_gate import ClientGate
from router.frontend import Frontend
from router.generation import Delta, ParsedRequest
from router.http.client_limits import ClientConcurrency
from router.http.requests import check_model, parse_chat, parse_completion
from router.sampling import SamplingError, sampling_from_proto


def parsed_request(request: pb.GenerateRequest, default_model: str) -> ParsedRequest:
    """A GenerateRequest as the front doors' ParsedRequest (or ApiError 400).

    The sampling converts with `sampling_from_proto` (the limits checked
    there, as for HTTP); the prompt or messages go through the OpenAI parser,
    so both front doors accept and refuse exactly the same inputs."""
    check_known_fields(request)
    inputs = [bool(request.prompt), bool(request.messages), bool(request.prompt_token_ids)]
    if sum(inputs) != 1:
        raise bad_request("set exactly one of prompt, messages, prompt_token_ids", "prompt")
    if request.sampling.prompt_logprobs:
        raise bad_request("sampling.prompt_logprobs is not supported by the router's gRPC API "
                          "(GenerateResponse has no field for them); use /v1/completions",
                          "prompt_logprobs")
    try:
        sampling = sampling_from_proto(request.sampling)
    except SamplingError as exc:
        raise exc.to_api_error() from None
    body: dict[str, Any] = {"model": request.model or default_model}
    if request.session_id:
        body["user"] = request.session_id
    if request.messages:
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        return parse_chat(body, sampling)
    body["prompt"] = request.prompt or list(request.prompt_token_ids)
    return parse_completion(body, sampling)


def check_known_fields(message: Message, path: str = "") -> None:
    """400 naming the first field `message` (or a message in it) carries
    that this server's pdserve.v1 does not define: a newer client's field,
    which protobuf keeps as an unknown field and nothing would read."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        number = unknown[0].field_number
        where = f"'{path}' ({message.DESCRIPTOR.full_name})" if path else (
            message.DESCRIPTOR.full_name)
        raise bad_request(f"{where} has field number {number}, which this server's proto does "
                          "not define: the router refuses what it cannot honour",
                          f"{path}.{number}" if path else str(number))
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue  # scalars; maps hold scalars here (logit_bias)
        name = f"{path}.{field.name}" if path else field.name
        items = enumerate(value) if field.is_repeated else [(None, value)]
        for index, item in items:
            check_known_fields(item, name if index is None else f"{name}[{index}]")


def response_message(request_id: str, delta: Delta) -> pb.GenerateResponse:
    message = pb.GenerateResponse(
        request_id=request_id,
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=delta.finish_reason or "",
    )
    if delta.logprobs:  # built only when asked for: this runs once per streamed message
        message.logprobs.extend(
            pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs)
            for lp in delta.logprobs
        )
    if delta.usage is not None:
        message.usage.CopyFrom(pb.Usage(
            prompt_tokens=delta.usage.prompt_tokens,
            completion_tokens=delta.usage.completion_tokens,
            cached_tokens=delta.usage.cached_tokens,
        ))
    return message


class RouterServicer(pdserve_pb2_grpc.RouterServicer):
    """Router.Generate / Router.ListModels over a `Frontend`."""

    def __init__(self, frontend: Frontend, auth: ApiKeyCheck,
                 gate: ClientGate | None = None) -> None:
        self._frontend = frontend
        self._auth = auth
        self._gate = gate or ClientGate(auth, ClientConcurrency(0))

    def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        self._auth.check(metadata.get("authorization"))

    def _admit(self, context: grpc.aio.ServicerContext):
        """The call's client slot and token-rate check, as on the HTTP front
        door (router/client_gate.py): its API key, else the peer's address
        without its port (`ipv4:127.0.0.1:5001` -> `ipv4:127.0.0.1`)."""
        metadata = dict(context.invocation_metadata() or ())
        address = (context.peer() or "unknown").rpartition(":")[0]
        return self._gate.admit(metadata.get("authorization"), address)

    def _parse(self, request: pb.GenerateRequest) -> ParsedRequest:
        parsed = parsed_request(request, self._frontend.model_name)
        check_model(parsed.model, self._frontend.model_name)
        return parsed

    @grpc_errors
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            self._check_auth(context)
            with self._admit(context):
                generation = await self._frontend.prepare(self._parse(request),
                                                          request.session_id)
                request_id = request.request_id or generation.request_id
                async with contextlib.aclosing(self._frontend.flow(generation).run()) as deltas:
                    async for delta in deltas:
                        yield response_message(request_id, delta)
        except ApiError as exc:
            raise ServiceError(exc.grpc_code, exc.message) from None

    @grpc_errors
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        try:
            self._check_auth(context)
        except ApiError as exc:
            raise ServiceError(exc.grpc_code, exc.message) from None
        frontend = self._frontend
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            id=frontend.model_name, max_model_len=frontend.max_model_len,
            created=frontend.created)])


def build_grpc_server(
    frontend: Frontend, auth: ApiKeyCheck, address: str, *, reuse_port: bool = False,
    tls: TlsFiles | None = None, gate: ClientGate | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A started-later server with Router + health bound to `address`;
    returns (server, bound port, health servicer — the router server sets
    it SERVING / NOT_SERVING as the pool's readiness changes). `reuse_port`:
    other router workers bind the same port (SO_REUSEPORT); off, a port
    already taken is an error rather than silently shared. `tls`: serve TLS
    (mutual with its CA file). `gate`: the per-client limits, shared with
    the HTTP front door."""
    options = [*GRPC_MESSAGE_OPTIONS, ("grpc.so_reuseport", 1 if reuse_port else 0)]
    server = grpc.aio.server(options=options)
    pdserve_pb2_grpc.add_RouterServicer_to_server(
        RouterServicer(frontend, auth, gate), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = add_port(server, address, tls)
    return server, port, health_servicer


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
