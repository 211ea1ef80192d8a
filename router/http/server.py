"""The router's OpenAI-compatible HTTP API (aiohttp).

Routes: POST /v1/completions, POST /v1/chat/completions (SSE with
`stream: true`), GET /v1/models, POST /tokenize and /detokenize
(router.http.tokenize), GET /health (the process is up),
GET /ready (503 until the pod pool can serve), GET /metrics (Prometheus),
GET /debug/requests/{id} (a finished request's timeline: docs/tracing.md).

Life of one generation request, all on the router's event loop:

1. the middleware checks the API key (/v1/* only) and turns any `ApiError`
   into OpenAI's error JSON with its status; a second one admits a
   generation request through the client gate (router.client_gate: its
   concurrency slot, its key's token rate) for the request's whole life;
2. the handler reads the body within the input limits (router.http.body:
   413 over the size limit, 400 for JSON too deep or not valid text),
   validates it (router.http.requests), checks the model name, tokenizes
   through the `Frontend` (a long prompt off the event loop) and starts a flow;
3. the first delta is awaited *before* the response starts, so routing
   failures (503) and pod refusals (400) get a real status code; after
   that, a streaming response sends one SSE chunk per delta and ends with
   `data: [DONE]` (a later error is sent as an `{"error": ...}` event);
   once a stream decodes steadily, the decode session's reader writes its
   plain deltas itself (`SseSink`, router.flow.direct_relay);
4. the app runs with handler cancellation on: a client that disconnects
   cancels the handler task, which closes the flow and cancels its pod calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import HttpVersion11, web

from proto.roles import PodRole
from router.api_error import ApiError
from router.auth import OPEN_PATHS, ApiKeyCheck
from router.client_gate import ClientGate
from router.frontend import Frontend
from router.generation import Delta, ParsedRequest
from router.http.body import read_json
from router.http.choices import serve_choices
from router.http.client_limits import ClientConcurrency
from router.http.echo import EchoPrompt, echo_prompt
from router.http.requests import check_model, parse_chat, parse_completion
from router.http.responses import DONE_EVENT, ResponseShaper, sse_event, token_id_text
from router.http.stream_sink import SseSink
from router.http.tokenize import detokenize_body, tokenize_body
from router.metrics import CONTENT_TYPE
from router.routing.base import PodPool
from router.tools.extractor import ToolCallDeltas
from telemetry.context import from_headers

log = logging.getLogger(__name__)

FRONTEND = web.AppKey("frontend", Frontend)
POOL = web.AppKey("pool", PodPool)
AUTH = web.AppKey("auth", ApiKeyCheck)
GATE = web.AppKey("client_gate", ClientGate)
API_KEY = web.RequestKey("api_key", object)  # the ApiKey it presented (None: no keys)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
INLINE_ECHO_TOKENS = 256  # echoed prompts rendered on the event loop; longer ones off it


def _internal_error(exc: BaseException) -> ApiError:
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                    error_type="internal_error")


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers())


@web.middleware
async def _errors_and_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        if request.path not in OPEN_PATHS:
            # the key's name: a request's timeline is shown to its own key only
            request[API_KEY] = request.app[AUTH].check(request.headers.get("Authorization"))
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = "not_found" if exc.status == 404 else None
        return error_response(
            ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", code=code)
        )
    except ConnectionResetError:
        raise  # the client left mid-response; the flow has already been closed
    except Exception as exc:  # a bug: still answer in OpenAI's shape, and keep serving
        log.exception("%s %s failed", request.method, request.path)
        return error_response(_internal_error(exc))


@web.middleware
async def _client_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Inside `_errors_and_auth`: a generation request takes its client's
    slot and token-rate check (router/client_gate.py) for its whole life."""
    if request.path not in GENERATION_PATHS:
        return await handler(request)
    with request.app[GATE].admit(request.headers.get("Authorization"), request.remote):
        return await handler(request)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    frontend = request.app[FRONTEND]
    body = await read_json(request, frontend.limits, frontend.max_model_len,
                           frontend.run_blocking)
    parsed = parse_chat(body) if kind == "chat" else parse_completion(body)
    check_model(parsed.model, frontend.model_name)
    generation = await frontend.prepare(parsed, request.headers.get("x-session-id"))
    key = request.get(API_KEY)
    generation = dataclasses.replace(generation, trace=from_headers(
        request.headers, key.name if key is not None else None, frontend.model_name))
    prompt = await _prompt_shown(frontend, parsed, generation.prompt_token_ids)
    created = int(time.time())

    def make_shaper(index: int = 0) -> ResponseShaper:
        return ResponseShaper(
            kind=kind,
            response_id=("chatcmpl-" if kind == "chat" else "cmpl-") + generation.request_id,
            model=frontend.model_name,
            created=created,
            token_text=token_id_text if parsed.tokens_as_ids else frontend.token_text,
            include_usage=parsed.include_usage,
            top_logprobs=parsed.sampling.logprobs,
            index=index,
            prompt=prompt,
            prompt_logprobs=body.get("prompt_logprobs") if kind == "completion" else None,
        )

    if parsed.n > 1:
        return await serve_choices(request, n=parsed.n, stream=parsed.stream,
                                   generation=generation, make_shaper=make_shaper,
                                   run_flow=lambda g: frontend.flow(g).run())
    shaper = make_shaper()
    flow = frontend.flow(generation)
    extractor = frontend.tool_extractor(parsed)
    # the direct relay (router.flow.direct_relay): HTTP/1.1 streams whose
    # deltas the handler does not rework (tool calls do)
    sink = SseSink(request, shaper) if (parsed.stream and extractor is None
                                        and request.version == HttpVersion11) else None
    async with contextlib.aclosing(flow.run(sink)) as flow_deltas:
        deltas = flow_deltas if extractor is None else ToolCallDeltas(flow_deltas, extractor)
        first = await anext(deltas)  # ApiError here still gets its own status
        if not parsed.stream:
            delta = first
            shaper.collect(delta)
            async for delta in deltas:
                shaper.collect(delta)
            assert delta.finish_reason is not None and delta.usage is not None
            return web.json_response(shaper.final_body(delta.finish_reason, delta.usage))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        if sink is not None:
            response.enable_chunked_encoding()  # the framing SseSink writes too
        await response.prepare(request)
        role = shaper.role_chunk()
        if role is not None:
            await response.write(sse_event(role))
            if sink is not None:
                sink.open()
        try:
            await _stream(response, shaper, sink, first, deltas, generation.request_id)
        except ConnectionResetError:
            # the client closed its stream (a cancel, not a fault): the flow is
            # closed by aclosing below; aiohttp finishes a prepared response quietly
            log.debug("client left the stream of %s", generation.request_id)
        return response


async def _stream(response: web.StreamResponse, shaper: ResponseShaper, sink: SseSink | None,
                  first: Delta, deltas: AsyncIterator[Delta], request_id: str) -> None:
    """Write a started stream's events until its usage, then [DONE]; an error
    after the headers goes out as an event with "error" (OpenAI's clients
    raise on it). ConnectionResetError: the client has left."""
    delta = first
    try:
        while True:
            event = shaper.event(delta)
            if event is not None:
                await response.write(event)
                if sink is not None:
                    sink.open()
            if delta.usage is not None:
                usage = shaper.usage_chunk(delta.usage)
                if usage is not None:
                    await response.write(sse_event(usage))
                break
            delta = await anext(deltas)
    except ApiError as exc:
        # Headers are gone; OpenAI clients raise on an event with "error".
        await response.write(sse_event(exc.body()))
    except ConnectionResetError:
        raise
    except Exception as exc:
        log.exception("stream of %s failed", request_id)
        await response.write(sse_event(_internal_error(exc).body()))
    await response.write(DONE_EVENT)
    await response.write_eof()


async def _prompt_shown(frontend: Frontend, parsed: ParsedRequest,
                        token_ids: tuple[int, ...]) -> EchoPrompt | None:
    """The prompt a completion response shows (echo, prompt_logprobs), or None."""
    sampling = parsed.sampling
    if parsed.kind != "completion" or not sampling.scores_prompt:
        return None
    args = (sampling.echo, parsed.prompt, token_ids, frontend.tokenizer.decode,
            frontend.token_text)
    if len(token_ids) <= INLINE_ECHO_TOKENS:
        return echo_prompt(*args)
    return await frontend.run_blocking(echo_prompt, *args)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def tokenize(request: web.Request) -> web.Response:
    frontend = request.app[FRONTEND]
    body = await read_json(request, frontend.limits, frontend.max_model_len,
                           frontend.run_blocking)
    return web.json_response(await frontend.run_blocking(tokenize_body, frontend, body))


async def detokenize(request: web.Request) -> web.Response:
    frontend = request.app[FRONTEND]
    body = await read_json(request, frontend.limits, frontend.max_model_len,
                           frontend.run_blocking)
    return web.json_response(await frontend.run_blocking(detokenize_body, frontend, body))


async def models(request: web.Request) -> web.Response:
    frontend = request.app[FRONTEND]
    return web.json_response({
        "object": "list",
        "data": [{
            "id": frontend.model_name,
            "object": "model",
            "created": frontend.created,
            "owned_by": "pdserve",
            "max_model_len": frontend.max_model_len,
        }],
    })


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    counts = {str(role): len(pool.pods(role)) for role in PodRole}
    if pool.is_ready():
        return web.json_response({"status": "ready", "healthy_pods": counts})
    return web.json_response(
        {"status": "not ready",
         "reason": "need >= 1 healthy prefill and >= 1 healthy decode pod, or >= 1 healthy "
                   "colocated pod",
         "healthy_pods": counts},
        status=503,
    )


async def metrics(request: web.Request) -> web.Response:
    body = request.app[FRONTEND].deps.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def debug_request(request: web.Request) -> web.Response:
    """GET /debug/requests/{id}: a finished request's timeline (telemetry.history).
    With API keys, a key sees only the requests made with it."""
    request_id = request.match_info["request_id"]
    history = request.app[FRONTEND].deps.history
    timeline = history.find(request_id) if history is not None else None
    key = request.get(API_KEY)
    if timeline is not None and key is not None and timeline.key_name != key.name:
        timeline = None  # another key's request is not this key's to see, nor to know of
    if timeline is None:
        kept = history.size if history is not None else 0
        raise ApiError(404, f"no finished request {request_id!r} is known to this router: "
                            f"it keeps the last {kept} finished requests (--trace-history) "
                            "and only those made with the same API key", code="not_found")
    return web.json_response(timeline.to_json())


def build_app(frontend: Frontend, pool: PodPool, auth: ApiKeyCheck,
              gate: ClientGate | None = None) -> web.Application:
    """The aiohttp application; run it with `TimedAppRunner(app, timeouts,
    handler_cancellation=True)` (router.http.connection). Bodies over
    `frontend.limits.max_body_bytes` get 413. `gate`: per-client limits
    (default: none beyond the key check)."""
    app = web.Application(middlewares=[_errors_and_auth, _client_gate],
                          client_max_size=frontend.limits.max_body_bytes)
    app[FRONTEND] = frontend
    app[POOL] = pool
    app[AUTH] = auth
    app[GATE] = gate or ClientGate(auth, ClientConcurrency(0))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/requests/{request_id}", debug_request)
    return app
