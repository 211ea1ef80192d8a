"""The HTTP front door against in-process fake pods: validation while good
traffic flows, SSE framing, auth, readiness, 503s, disconnects, metrics."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from engine.tokenizer import Tokenizer
from tests.router.http_harness import fake_cluster
from tests.router.inprocess_pods import Behaviour, expected_token

pytestmark = pytest.mark.timeout(120)
# cached_tokens on the decode side must not count: only the prefill pod computed the prompt
PD = {"prefill": [Behaviour(cached_tokens=2)], "decode": [Behaviour(delay=0.01, cached_tokens=3)]}


def run(coro):
    return asyncio.run(coro)


def _url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.http_port}{path}"


async def _sse(response: aiohttp.ClientResponse) -> list[object]:
    """The parsed `data:` events of a stream ([DONE] kept as the string)."""
    raw = (await response.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: ")
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _expected_text(tokenizer: Tokenizer, prompt_ids: list[int], n: int) -> str:
    return tokenizer.decode([expected_token(prompt_ids, i) for i in range(n)])


BAD_REQUESTS = [
    (b"{not json", 400, None, "the request body is not valid JSON"),
    ({"prompt": "x"}, 400, "model", "'model' is required"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens",
     "'max_tokens' must be at least 1, got 0"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens",
     "'max_tokens' must be an integer, got str"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature",
     "'temperature' must be in [0, 2], got -1.0"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p", "'top_p' must be in (0, 1]"),
    ({"model": "tiny", "prompt": "x", "n": 30}, 400, "n", "must be an integer in [1, 16]"),
    ({"model": "tiny", "prompt": "x", "logprobs": 50}, 400, "logprobs",
     "'logprobs' must be in [0, 20], got 50"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 100}, 400, "max_tokens",
     "this model's maximum context length is 64 tokens"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "The model 'gpt-4' does not exist"),
    ({"model": "tiny", "prompt": [5000]}, 400, "prompt",
     "'prompt' token id 5000 is outside the vocabulary (size 1100)"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"1100": 1}}, 400, "logit_bias",
     "'logit_bias' holds token id 1100, outside the vocabulary [0, 1100)"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [5, 1100]}, 400, "stop_token_ids",
     "'stop_token_ids' holds token id 1100, outside the vocabulary [0, 1100)"),
]


def test_validation_while_a_good_stream_runs(tiny_model_dir):
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)

    async def main():
        async with fake_cluster(tiny_model_dir, PD, max_model_len=64) as (server, _), \
                aiohttp.ClientSession() as http:
            async def good():
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 30, "stream": True}
                async with http.post(_url(server, "/v1/completions"), json=body) as r:
                    assert r.status == 200
                    return await _sse(r)

            good_task = asyncio.create_task(good())
            for body, status, param, fragment in BAD_REQUESTS:
                kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
                async with http.post(_url(server, "/v1/completions"), **kwargs) as r:
                    error = (await r.json())["error"]
                    assert r.status == status, (body, error)
                    assert fragment in error["message"], (body, error)
                    assert error["param"] == param
                    assert error["type"] == "invalid_request_error"
            assert not good_task.done()  # the checks ran while the stream was open
            events = await good_task
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == _expected_text(tokenizer, tokenizer.encode("hello"), 30)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    run(main())


def test_completion_stream_framing_with_usage(tiny_model_dir):
    async def main():
        async with fake_cluster(tiny_model_dir, PD) as (server, _), \
                aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with http.post(_url(server, "/v1/completions"), json=body) as r:
                assert r.headers["Content-Type"] == "text/event-stream"
                events = await _sse(r)
        chunks, usage, done = events[:-2], events[-2], events[-1]
        assert done == "[DONE]"
        assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert usage["choices"] == []
        assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                  "prompt_tokens_details": {"cached_tokens": 2}}
        assert len({c["id"] for c in events[:-1]}) == 1
    run(main())


def test_chat_stream_and_non_stream(tiny_model_dir):
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "hi"}]
    prompt_ids = tokenizer.encode_chat(messages)

    async def main():
        async with fake_cluster(tiny_model_dir, PD) as (server, _), \
                aiohttp.ClientSession() as http:
            body = {"model": "tiny", "messages": messages, "max_tokens": 6}
            async with http.post(_url(server, "/v1/chat/completions"),
                                 json={**body, "stream": True}) as r:
                events = await _sse(r)
            async with http.post(_url(server, "/v1/chat/completions"), json=body) as r:
                whole = await r.json()
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        expected = _expected_text(tokenizer, prompt_ids, 6)
        assert streamed == expected
        assert whole["object"] == "chat.completion"
        assert whole["choices"][0]["message"] == {"role": "assistant", "content": expected}
        assert whole["usage"]["prompt_tokens"] == len(prompt_ids)
    run(main())


def test_api_key_and_open_probes(tiny_model_dir):
    async def main():
        async with fake_cluster(tiny_model_dir, PD, api_key="k3y") as (server, _), \
                aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            async with http.post(_url(server, "/v1/completions"), json=body) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "invalid_api_key"
            async with http.get(_url(server, "/v1/models"),
                                headers={"Authorization": "Bearer nope"}) as r:
                assert r.status == 401
                assert (await r.json())["error"]["message"] == "Incorrect API key provided"
            async with http.get(_url(server, "/v1/models"),
                                headers={"Authorization": "Bearer k3y"}) as r:
                models = await r.json()
            for path in ("/health", "/ready", "/metrics"):
                async with http.get(_url(server, path)) as r:
                    assert r.status == 200, path
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 4096
    run(main())


def test_not_ready_and_503_with_reason(tiny_model_dir):
    async def main():
        async with fake_cluster(tiny_model_dir, {"decode": [Behaviour()]}) as (server, _), \
                aiohttp.ClientSession() as http:
            async with http.get(_url(server, "/ready")) as r:
                assert r.status == 503
                assert (await r.json())["healthy_pods"] == {"prefill": 0, "decode": 1,
                                                            "colocated": 0}
            body = {"model": "tiny", "prompt": "hi", "stream": True}
            async with http.post(_url(server, "/v1/completions"), json=body) as r:
                assert r.status == 503
                error = (await r.json())["error"]
        assert error["code"] == "no_pod_available"
        assert "no healthy prefill pod and no healthy colocated pod" in error["message"]
    run(main())


def test_client_disconnect_cancels_the_pod_stream(tiny_model_dir):
    async def main():
        roles = {"colocated": [Behaviour(delay=0.05)]}
        async with fake_cluster(tiny_model_dir, roles) as (server, pods), \
                aiohttp.ClientSession() as http:
            pod = pods["colocated"][0]
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "stream": True}
            async with http.post(_url(server, "/v1/completions"), json=body) as r:
                await r.content.readline()  # the first event arrived: the pod is streaming
                assert len(pod.active) == 1
            # leaving the block closed the connection mid-stream
            for _ in range(100):
                if not pod.active:
                    break
                await asyncio.sleep(0.05)
            assert not pod.active and len(pod.cancelled) == 1
            async with http.get(_url(server, "/metrics")) as r:
                metrics = await r.text()
        assert 'pdserve_aborts_total{reason="client_disconnect"} 1.0' in metrics
    run(main())


def test_router_never_imports_torch():
    code = ("import sys, router.server, router.http.server, router.grpc_server, "
            "pdserve.commands.router; assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_internal_error_keeps_openai_shape_and_serving(tiny_model_dir, monkeypatch):
    from router.frontend import Frontend

    real_prepare = Frontend.prepare

    def prepare(self, parsed, session_id):
        if parsed.prompt == "boom":
            raise RuntimeError("tokenizer exploded")
        return real_prepare(self, parsed, session_id)

    monkeypatch.setattr(Frontend, "prepare", prepare)

    async def main():
        async with fake_cluster(tiny_model_dir, PD) as (server, _), \
                aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "boom", "max_tokens": 2}
            async with http.post(_url(server, "/v1/completions"), json=body) as r:
                assert r.status == 500
                assert await r.json() == {"error": {
                    "message": "internal error: RuntimeError: tokenizer exploded",
                    "type": "internal_error", "param": None, "code": None}}
            async with http.post(_url(server, "/v1/completions"),
                                 json={**body, "prompt": "fine"}) as r:
                assert r.status == 200
    run(main())


def _sample(metrics: str, name: str) -> float:
    """The value of sample `name` (with its labels, as /metrics writes it); 0 when absent."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


OK = 'pdserve_router_requests_total{outcome="ok"}'
E2E = 'pdserve_e2e_request_latency_seconds_count{path="disaggregated",role="router"}'
E2E_SUM = 'pdserve_e2e_request_latency_seconds_sum{path="disaggregated",role="router"}'


def test_a_finished_request_counts_ok_once_and_one_e2e_latency(tiny_model_dir):
    """One router process (tests/router/test_workers.py checks the sums over
    --workers 2): a stream read to its [DONE] and a whole response each add
    exactly one `ok` and one e2e observation, and no other outcome."""
    async def main():
        async with fake_cluster(tiny_model_dir, PD) as (server, _), \
                aiohttp.ClientSession() as http:
            async def metrics() -> str:
                async with http.get(_url(server, "/metrics")) as r:
                    return await r.text()

            seen = [await metrics()]
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 5}
            async with http.post(_url(server, "/v1/completions"),
                                 json={**body, "stream": True}) as r:
                events = await _sse(r)
            seen.append(await metrics())
            async with http.post(_url(server, "/v1/completions"), json=body) as r:
                whole = await r.json()
            seen.append(await metrics())
        return events, whole, seen

    events, whole, seen = run(main())
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["finish_reason"] == "length"
    assert [(_sample(m, OK), _sample(m, E2E)) for m in seen] == [(0, 0), (1, 1), (2, 2)]
    assert 0 < _sample(seen[1], E2E_SUM) < _sample(seen[2], E2E_SUM)
    outcomes = {line.split(" ")[0] for m in seen for line in m.splitlines()
                if line.startswith("pdserve_router_requests_total{")}
    assert outcomes == {OK}
