"""The clients `pdserve bench router --open-loop` compares
(benchmarks/router_open_loop.py), each an `OpenStream`: `direct_client`
does the router's flow by hand against the pods (Decode.Generate with
remote prefill, then Prefill), `router_client` calls the router's gRPC
front door, `router_http_client` its HTTP one (/v1/completions, SSE). Same
prompt token ids, same output length; each yields token counts as they
arrive. They run on the benchmark's event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

# a stream factory: (request id, prompt, max_tokens) -> async iterator of
# token counts, one per message that carried tokens
OpenStream = Callable[[str, list[int], int], AsyncIterator[int]]


def direct_client(pb, prefill_stub, decode_stub) -> OpenStream:
    """The router's flow done by hand: Decode.Generate(remote_prefill) ->
    Reserved -> Prefill.Prefill(target) -> first token -> decode stream."""
    import grpc

    async def stream(request_id: str, prompt: list[int], max_tokens: int
                     ) -> AsyncIterator[int]:
        sampling = pb.SamplingParams(max_tokens=max_tokens, top_p=1.0, ignore_eos=True)
        call = decode_stub.Generate(pb.DecodeGenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
            remote_prefill=True))
        try:
            first = await call.read()
            prefill = prefill_stub.Prefill(pb.PrefillRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                target=first.reserved.target))
            await prefill.read()  # the first token, before the transfer's verdict
            yield 1
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise RuntimeError(f"decode stream of {request_id} ended without a finish")
                if message.tokens.token_ids:
                    yield len(message.tokens.token_ids)
                if message.tokens.finish_reason:
                    while await prefill.read() is not grpc.aio.EOF:  # the verdict
                        pass
                    return
        finally:
            call.cancel()  # no-op once finished; frees the pod when we leave early

    return stream


def router_client(pb, router_stub) -> OpenStream:
    """Router.Generate with the same prompt token ids (and a session id)."""

    async def stream(request_id: str, prompt: list[int], max_tokens: int
                     ) -> AsyncIterator[int]:
        sampling = pb.SamplingParams(max_tokens=max_tokens, top_p=1.0, ignore_eos=True)
        call = router_stub.Generate(pb.GenerateRequest(
            prompt_token_ids=prompt, sampling=sampling, request_id=request_id,
            session_id=f"session-{hash(request_id) % 1000}"))
        try:
            async for message in call:
                if message.token_ids:
                    yield len(message.token_ids)
                if message.finish_reason:
                    return
            raise RuntimeError(f"router stream of {request_id} ended without a finish")
        finally:
            call.cancel()

    return stream


def router_http_client(http, base_url: str, model: str) -> OpenStream:
    """/v1/completions through the router's HTTP front door, streamed (SSE),
    the same prompt token ids and session id as `router_client`; one
    token per event with text, and at the end any tokens the final usage
    counts beyond those (text the detokenizer held back to a later event)."""
    import json

    async def stream(request_id: str, prompt: list[int], max_tokens: int
                     ) -> AsyncIterator[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0, "top_p": 1.0,
                "stream_options": {"include_usage": True},
                "user": f"session-{hash(request_id) % 1000}"}
        events = 0
        async with http.post(f"{base_url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0]["text"]:
                    events += 1
                    yield 1
                elif event.get("usage"):
                    # a token whose text the detokenizer held back arrives in a later event
                    missing = event["usage"]["completion_tokens"] - events
                    if missing > 0:
                        yield missing
                    return
        raise RuntimeError(f"router stream of {request_id} ended without usage")

    return stream
