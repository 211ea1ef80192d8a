"""`n > 1`: several choices for one prompt, each its own generation.

Called by router.http.server's handler on the event loop when a request
asks for `n > 1` (n == 1 never comes here). Choice i is a `GenerationRequest`
of its own (`<request id>-<i>`) with the same prompt token ids and the same
session id, so it is routed like choice 0 (sticky or by prefix affinity to
the same prefill pod). Choice 0 starts first; the others start once its
first token is out, which means its prefill is done and its prompt's blocks
are in that pod's prefix cache: they compute only the prompt's last partial
block, and what they transfer to their decode pods is the same prompt KV.

Seeds: choice 0 keeps the request's seed (so `n = 1` and choice 0 of
`n = 3` agree); choice i > 0 draws from `choice_seed(seed, i)`, its own
seeded stream; its output index i keeps `seed_for_index` as every request's
does. Unseeded choices draw from the pods' generators; greedy choices are
all the same text, as in OpenAI's and vLLM's API.

Responses: `choices[i].index == i`; streaming interleaves the choices'
chunks in the order their tokens arrive, each chunk carrying one choice (as
OpenAI does); usage counts the prompt once and the completion tokens of all
choices (`cached_tokens` is choice 0's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import xxhash
from aiohttp import web

from router.api_error import ApiError
from router.generation import Delta, GenerationRequest, Usage
from router.http.responses import DONE_EVENT, ResponseShaper, sse_event, usage_body

log = logging.getLogger(__name__)

FlowFactory = Callable[[GenerationRequest], AsyncIterator[Delta]]


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index`: the request's own for choice 0."""
    if index == 0:
        return seed
    return xxhash.xxh64_intdigest(struct.pack("<QQ", seed, index), seed=0x63686F69)


def choice_requests(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """One GenerationRequest per choice (see the module docstring)."""
    seed = generation.sampling.seed
    return [replace(generation, request_id=f"{generation.request_id}-{i}",
                    sampling=replace(generation.sampling,
                                     seed=None if seed is None else choice_seed(seed, i)))
            for i in range(n)]


def summed_usage(usages: list[Usage]) -> Usage:
    return Usage(prompt_tokens=usages[0].prompt_tokens,
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=usages[0].cached_tokens)


class _Choices:
    """The n flows, merged into one queue of (index, delta or error)."""

    def __init__(self, requests: list[GenerationRequest], run_flow: FlowFactory) -> None:
        self._requests = requests
        self._run_flow = run_flow
        self._queue: asyncio.Queue[tuple[int, Delta | None, BaseException | None]] = (
            asyncio.Queue())
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> Delta:
        """Choice 0's first delta (an ApiError here still gets its status);
        then the other choices start."""
        first_seen: asyncio.Future[Delta] = asyncio.get_running_loop().create_future()
        self._tasks.append(asyncio.create_task(self._pump(0, first_seen)))
        first = await first_seen
        for i in range(1, len(self._requests)):
            self._tasks.append(asyncio.create_task(self._pump(i, None)))
        return first

    async def _pump(self, index: int, first_seen: asyncio.Future[Delta] | None) -> None:
        try:
            async with contextlib.aclosing(self._run_flow(self._requests[index])) as deltas:
                async for delta in deltas:
                    if first_seen is not None and not first_seen.done():
                        first_seen.set_result(delta)
                        continue  # the caller shows it
                    self._queue.put_nowait((index, delta, None))
        except Exception as exc:  # handed to the handler, which tells the client
            if first_seen is not None and not first_seen.done():
                first_seen.set_exception(exc)
            else:
                self._queue.put_nowait((index, None, exc))

    async def next(self) -> tuple[int, Delta]:
        index, delta, error = await self._queue.get()
        if error is not None:
            raise error
        assert delta is not None
        return index, delta

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def serve_choices(request: web.Request, *, n: int, stream: bool,
                        generation: GenerationRequest, run_flow: FlowFactory,
                        make_shaper: Callable[[int], ResponseShaper]) -> web.StreamResponse:
    """The whole response for an `n > 1` request."""
    shapers = [make_shaper(i) for i in range(n)]
    choices = _Choices(choice_requests(generation, n), run_flow)
    try:
        first = await choices.start()
        if not stream:
            return web.json_response(await _collect(choices, shapers, first))
        return await _stream(request, choices, shapers, first)
    finally:
        await choices.close()


async def _collect(choices: _Choices, shapers: list[ResponseShaper],
                   first: Delta) -> dict[str, Any]:
    finals: dict[int, Delta] = {}
    index, delta = 0, first
    while True:
        shapers[index].collect(delta)
        if delta.usage is not None:
            finals[index] = delta
            if len(finals) == len(shapers):
                break
        index, delta = await choices.next()
    bodies = [shaper.final_body(finals[i].finish_reason or "stop", finals[i].usage)
              for i, shaper in enumerate(shapers)]
    body = bodies[0]
    body["choices"] = [b["choices"][0] for b in bodies]
    body["usage"] = usage_body(summed_usage([finals[i].usage for i in range(len(shapers))]))
    return body


async def _stream(request: web.Request, choices: _Choices, shapers: list[ResponseShaper],
                  first: Delta) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for shaper in shapers:
        role = shaper.role_chunk()
        if role is not None:
            await response.write(sse_event(role))
    usages: dict[int, Usage] = {}
    index, delta = 0, first
    try:
        while True:
            event = shapers[index].event(delta)
            if event is not None:
                await response.write(event)
            if delta.usage is not None:
                usages[index] = delta.usage
                if len(usages) == len(shapers):
                    chunk = shapers[0].usage_chunk(summed_usage(
                        [usages[i] for i in range(len(shapers))]))
                    if chunk is not None:
                        await response.write(sse_event(chunk))
                    break
            index, delta = await choices.next()
    except ApiError as exc:
        await response.write(sse_event(exc.body()))
    except Exception as exc:
        log.exception("stream of %s failed", request.path)
        await response.write(sse_event(ApiError(500, f"internal error: {exc}",
                                                error_type="internal_error").body()))
    await response.write(DONE_EVENT)
    await response.write_eof()
    return response
