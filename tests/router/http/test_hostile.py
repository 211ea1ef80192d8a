"""Hostile HTTP input at the router (issue 11): each hostile request gets a
clear 4xx in OpenAI's error shape (never a 500, never a stalled loop), and the
official `openai` client is served right after it. A live in-process router
(RouterServer on loopback ports) over in-process fake pods; max_model_len 64,
so the derived limits are small: 2048 prompt characters, a 90,112-byte body."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import aiohttp
import openai
import pytest

from engine.tokenizer import Tokenizer
from router.limits import InputLimits
from tests.router.http_harness import fake_cluster
from tests.router.inprocess_pods import Behaviour

pytestmark = pytest.mark.timeout(120)
PD = {"prefill": [Behaviour()], "decode": [Behaviour()]}
LIMITS = InputLimits.for_context(64)


def _url(server, path: str = "/v1/completions") -> str:
    return f"http://127.0.0.1:{server.http_port}{path}"


async def _served_after(server) -> None:
    """The official client's request succeeds on the same router."""
    client = openai.AsyncOpenAI(base_url=_url(server, "/v1"), api_key="x", max_retries=0,
                                timeout=30)
    try:
        reply = await client.completions.create(model="tiny", prompt="hello", max_tokens=4)
    finally:
        await client.close()
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 4


async def _post_raw(server, body: bytes, path: str = "/v1/completions") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(
            _url(server, path), data=body,
            headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.json()


def _error(status: int, body: dict) -> tuple[int, str, str | None, str | None]:
    error = body["error"]
    return status, error["type"], error["param"], error["code"]


HOSTILE = [
    pytest.param(b"[" * 10_000 + b"]" * 10_000, 400,
                 ("invalid_request_error", None, "json_too_deep"),
                 "nests JSON more than 64 levels deep (the limit is 64)", id="nested-10000"),
    pytest.param(b'{"model": "tiny", "prompt": ' + b"[" * 10_000, 400,
                 ("invalid_request_error", None, "json_too_deep"),
                 "nests JSON more than 64 levels deep", id="nested-unclosed"),
    pytest.param(b'{"model": "tiny", "prompt": "ab\\ud800c"}', 400,
                 ("invalid_request_error", "prompt", None),
                 "'prompt' is not valid Unicode text: it holds a lone UTF-16 surrogate "
                 "(\\ud800 at character 2)", id="surrogate-prompt"),
    pytest.param(b'{"model": "tiny", "prompt": "ab\\ud800c", "user": "' + b"z" * 70_000 + b'"}',
                 400, ("invalid_request_error", "prompt", None),
                 "'prompt' is not valid Unicode text", id="surrogate-large-body-parsed-off-loop"),
    pytest.param(json.dumps({"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}).replace(
            "\\\\udfff", "\\udfff").encode(), 400,
                 ("invalid_request_error", "messages[0].content[0].text", None),
                 "'messages[0].content[0].text' is not valid Unicode text", id="surrogate-chat"),
    pytest.param(b'{"model": "tiny", "prompt": [' + b"7" * 5000 + b"]}", 400,
                 ("invalid_request_error", None, None),
                 "the request body is not valid JSON", id="5000-digit-number"),
    pytest.param(json.dumps({"model": "tiny", "prompt": "x" * 2049}).encode(), 400,
                 ("invalid_request_error", "prompt", None),
                 "'prompt' has 2049 characters, over the limit of 2048 (max_model_len 64 x 32 "
                 "characters per token): it cannot fit the context", id="prompt-chars"),
    pytest.param(json.dumps({"model": "tiny", "prompt": "x" * 100, "stop": "y" * 100,
                             "user": "z" * (LIMITS.max_body_bytes)}).encode(), 413,
                 ("invalid_request_error", None, "request_too_large"),
                 f"the request body is over the limit of {LIMITS.max_body_bytes} bytes "
                 "(max_model_len 64 x 384 bytes per token + 64 KiB)", id="body-size"),
]


@pytest.mark.parametrize(("body", "status", "error", "message"), HOSTILE)
def test_hostile_body_gets_a_clear_error_and_the_router_keeps_serving(
        tiny_model_dir, body, status, error, message):
    async def main():
        async with fake_cluster(tiny_model_dir, PD, max_model_len=64) as (server, _):
            path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
            got_status, got = await _post_raw(server, body, path)
            assert _error(got_status, got) == (status, *error)
            assert message in got["error"]["message"]
            await _served_after(server)

    asyncio.run(main())


def test_chat_content_over_the_character_limit(tiny_model_dir):
    async def main():
        async with fake_cluster(tiny_model_dir, PD, max_model_len=64) as (server, _):
            messages = [{"role": "system", "content": "s" * 1000},
                        {"role": "user", "content": "u" * 1049}]
            status, got = await _post_raw(server, json.dumps(
                {"model": "tiny", "messages": messages}).encode(), "/v1/chat/completions")
            assert _error(status, got) == (400, "invalid_request_error", "messages", None)
            assert got["error"]["message"].startswith(
                "the messages' content has 2049 characters, over the limit of 2048")
            await _served_after(server)

    asyncio.run(main())


def test_tokenizing_a_prompt_does_not_stall_other_clients(tiny_model_dir, monkeypatch):
    """A prompt whose tokenization is held (as a huge one would hold it): the
    event loop keeps serving; before the fix the whole router waited."""
    entered, release = threading.Event(), threading.Event()
    real_encode = Tokenizer.encode

    def encode(self, text, add_special_tokens=True):
        if text.startswith("HOLD"):
            entered.set()
            release.wait(5)  # a deadline: a loop blocked here cannot fail the test itself
        return real_encode(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", encode)

    async def main():  # a context of 4096: room for a prompt long enough to leave the loop
        async with fake_cluster(tiny_model_dir, PD) as (server, _):
            held = asyncio.create_task(_post_raw(server, json.dumps(
                {"model": "tiny", "prompt": "HOLD " + "hello " * 1000,
                 "max_tokens": 2}).encode()))
            assert await asyncio.to_thread(entered.wait, 10)
            await _served_after(server)
            still_held = not release.is_set() and not held.done()
            release.set()
            status, body = await held
            return still_held, status, body

    still_held, status, body = asyncio.run(main())
    assert still_held, "the other client was served only after the held tokenization"
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


def _closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the peer closed `sock` (recv returns b""), None if still open."""
    sock.settimeout(timeout)
    started = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    return time.monotonic() - started


def test_header_and_keepalive_timeouts_close_idle_connections(tiny_model_dir):
    """Partial headers are cut off after --http-header-timeout, a silent
    connection after --http-keepalive-timeout; a stream longer than both runs
    to its end."""
    slow = {"prefill": [Behaviour()], "decode": [Behaviour(delay=0.05)]}

    async def main():
        async with fake_cluster(tiny_model_dir, slow, max_model_len=64,
                                http_header_timeout=0.5, http_keepalive_timeout=1.5) as (
                server, _):
            address = ("127.0.0.1", server.http_port)
            partial = socket.create_connection(address)
            partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
            silent = socket.create_connection(address)
            partial_closed = await asyncio.to_thread(_closed_within, partial, 10)
            silent_open = await asyncio.to_thread(_closed_within, silent, 0.3)
            silent_closed = await asyncio.to_thread(_closed_within, silent, 10)
            client = openai.AsyncOpenAI(base_url=_url(server, "/v1"), api_key="x",
                                        max_retries=0, timeout=30)
            try:  # 40 tokens x 0.05 s: longer than both timeouts
                chunks = [c async for c in await client.completions.create(
                    model="tiny", prompt="hello", max_tokens=40, stream=True)]
            finally:
                await client.close()
            partial.close()
            silent.close()
            return partial_closed, silent_open, silent_closed, chunks

    partial_closed, silent_open, silent_closed, chunks = asyncio.run(main())
    assert partial_closed is not None and 0.4 < partial_closed < 1.4
    assert silent_open is None  # not closed by the header timeout
    assert silent_closed is not None  # ...but by the keep-alive timeout
    assert chunks[-1].choices[0].finish_reason == "length"


def test_per_client_concurrency_limit_answers_429(tiny_model_dir):
    slow = {"prefill": [Behaviour()], "decode": [Behaviour(delay=0.05)]}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 40, "stream": True}

    async def main():
        async with fake_cluster(tiny_model_dir, slow, max_model_len=64,
                                max_concurrent_per_client=2) as (server, _), \
                aiohttp.ClientSession() as http, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                    local_addr=("127.0.0.2", 0))) as other:
            streams = [await http.post(_url(server), json=body) for _ in range(2)]
            for stream in streams:  # both hold their slot until their last event
                assert stream.status == 200
                await stream.content.readline()
            async with http.post(_url(server), json=body) as refused:
                status, got, retry = refused.status, await refused.json(), \
                    refused.headers.get("Retry-After")
            async with other.post(_url(server), json={**body, "stream": False}) as elsewhere:
                other_status = elsewhere.status
            for stream in streams:
                await stream.read()
                stream.release()
            await _served_after(server)
            return status, got, retry, other_status

    status, got, retry, other_status = asyncio.run(main())
    assert _error(status, got) == (429, "rate_limit_error", None, "concurrency_limit_exceeded")
    assert got["error"]["message"] == (
        "too many concurrent requests from this client address: 2 in flight, the limit is 2 "
        "per client address (--max-concurrent-per-client); retry when one has finished")
    assert retry == "1"
    assert other_status == 200  # another client is not limited by this one
