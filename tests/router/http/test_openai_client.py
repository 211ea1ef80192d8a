"""The proof tests of the serving path: real pod processes (tiny model), real
router processes, the official `openai` client.

Cluster (module scope): one prefill, one decode and one colocated pod; one
router over the P/D pair, one over the colocated pod, one with an API key.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.pods import start_pod
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(start_pod, role, tiny_model_dir)
                   for role in ("prefill", "decode", "colocated")]
        pods = [f.result() for f in futures]
    prefill, decode, colocated = pods
    routers = {}
    try:
        routers["pd"] = start_router(tiny_model_dir, prefill=[prefill.address],
                                     decode=[decode.address])
        routers["co"] = start_router(tiny_model_dir, colocated=[colocated.address])
        routers["key"] = start_router(tiny_model_dir, colocated=[colocated.address],
                                      api_key="s3cret")
        for router in routers.values():
            wait_ready(router)
        yield {"prefill": prefill, "decode": decode, "colocated": colocated, **routers}
    finally:
        for router in routers.values():
            router.terminate()
        for pod in pods:
            pod.kill()


def _client(router, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key=key, max_retries=0, timeout=120)


def _grpc_generate(router, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
        messages = list(stub.Generate(request, timeout=120))
    assert messages[-1].finish_reason == "length"
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages)


def test_openai_client_completions(cluster):
    client = _client(cluster["pd"])
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 16
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_cached_tokens_are_real_prefix_hits(cluster):
    client = _client(cluster["pd"])
    prompt = " ".join(f"word{i}" for i in range(80))  # many blocks long
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens


def test_openai_client_chat(cluster):
    client = _client(cluster["pd"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_disaggregated_equals_colocated_and_grpc_equals_http(cluster):
    for prompt in PROMPTS:
        pd_tokens, pd_text = _grpc_generate(cluster["pd"], prompt, 24)
        co_tokens, co_text = _grpc_generate(cluster["co"], prompt, 24)
        assert pd_tokens == co_tokens and len(pd_tokens) == 24
        assert pd_text == co_text
        http_text = _client(cluster["pd"]).completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text
        assert http_text == pd_text


def test_tokens_as_token_ids_are_the_generated_ids(cluster):
    """`return_tokens_as_token_ids` (vLLM's extension): logprobs name each
    output token by its id, on both endpoints, streamed or not; the ids are
    the ones the gRPC API returns."""
    ids, _ = _grpc_generate(cluster["pd"], PROMPTS[1], 12)
    client = _client(cluster["pd"])
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12,
                                      temperature=0, logprobs=0, extra_body=extra)
    assert whole.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    streamed = [t for c in client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=0,
        stream=True, extra_body=extra) if c.choices for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.choices[0].logprobs.tokens
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body=extra)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(e.token.startswith("token_id:") for e in content)
    assert all(t.token.startswith("token_id:") for e in content for t in e.top_logprobs)
    status, body = _post(cluster["pd"], {"model": "tiny", "prompt": "x",
                                         "return_tokens_as_token_ids": "yes"})
    assert status == 400
    assert "'return_tokens_as_token_ids' must be a boolean" in body["error"]["message"]


def _post(router, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(router.url("/v1/completions"), data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_validation_errors_while_a_good_request_runs(cluster):
    router = cluster["pd"]
    good: dict = {}

    def run_good():
        good["result"] = _post(router, {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 200,
                                        "temperature": 0, "ignore_eos": True})

    thread = threading.Thread(target=run_good)
    thread.start()
    cases = [
        (b"{oops", 400, "the request body is not valid JSON"),
        ({"model": "tiny"}, 400, "'prompt' is required"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400,
         "'max_tokens' must be at least 1"),
        ({"model": "tiny", "prompt": "x", "temperature": 3}, 400,
         "'temperature' must be in [0, 2]"),
        ({"model": "tiny", "prompt": "x", "top_p": 2}, 400, "'top_p' must be in (0, 1]"),
        ({"model": "tiny", "prompt": "x", "n": 17}, 400, "'n' must be an integer in [1, 16]"),
        ({"model": "tiny", "prompt": "x", "logprobs": -1}, 400, "'logprobs' must be in [0, 20]"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 5000}, 400,
         "maximum context length is 4096 tokens"),
        ({"model": "nope", "prompt": "x"}, 404, "The model 'nope' does not exist"),
    ]
    for body, status, fragment in cases:
        code, payload = _post(router, body)
        assert code == status, payload
        assert fragment in payload["error"]["message"]
        assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert thread.is_alive()  # every refusal came back while the good request was decoding
    thread.join(120)
    status, payload = good["result"]
    assert status == 200 and payload["usage"]["completion_tokens"] == 200


def test_api_key(cluster):
    with pytest.raises(openai.AuthenticationError) as info:
        _client(cluster["key"], key="wrong").completions.create(model="tiny", prompt="x",
                                                                 max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.body == {"message": "Incorrect API key provided",
                               "type": "invalid_request_error", "param": None,
                               "code": "invalid_api_key"}
    ok = _client(cluster["key"], key="s3cret").completions.create(model="tiny", prompt="x",
                                                                  max_tokens=2)
    assert ok.usage.completion_tokens == 2


def _decode_load(pod) -> pb.LoadReport:
    with grpc.insecure_channel(pod.address) as channel:
        return pdserve_pb2_grpc.DecodeStub(channel).GetLoad(pb.LoadRequest(), timeout=10)


def test_client_disconnect_frees_decode_blocks(cluster):
    baseline = _decode_load(cluster["decode"]).num_free_blocks
    connection = http.client.HTTPConnection("127.0.0.1", cluster["pd"].http_port, timeout=60)
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event: the request is decoding now
    # the reservation holds blocks for prompt + max_tokens from admission on
    assert _decode_load(cluster["decode"]).num_free_blocks < baseline
    connection.sock.close()  # the client goes away mid-stream
    connection.close()
    deadline = time.monotonic() + 30
    while _decode_load(cluster["decode"]).num_free_blocks != baseline:
        assert time.monotonic() < deadline, "decode pod never freed the request's blocks"
        time.sleep(0.1)
    assert _decode_load(cluster["decode"]).num_running == 0
    deadline = time.monotonic() + 10
    while cluster["pd"].metric("pdserve_aborts_total", reason="client_disconnect") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_no_pod_is_503_with_reason(tiny_model_dir):
    router = start_router(tiny_model_dir, prefill=["127.0.0.1:9"], decode=["127.0.0.1:7"])
    try:
        with pytest.raises(urllib.error.HTTPError) as ready:
            urllib.request.urlopen(router.url("/ready"), timeout=10)
        assert ready.value.code == 503
        status, payload = _post(router, {"model": "tiny", "prompt": "x"})
    finally:
        exit_status = router.terminate()
    assert exit_status == 0  # SIGTERM is a clean shutdown
    assert status == 503
    assert payload["error"]["code"] == "no_pod_available"
    assert payload["error"]["message"].startswith("no pod can serve the request: no healthy "
                                                  "prefill pod and no healthy colocated pod")


def test_sigterm_finishes_in_flight_requests(cluster, tiny_model_dir):
    router = start_router(tiny_model_dir, colocated=[cluster["colocated"].address])
    try:
        wait_ready(router)
        stream = _client(router).completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=150, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        chunks = [next(stream)]  # the request is in flight
        router.process.send_signal(signal.SIGTERM)
        chunks.extend(stream)
    finally:
        exit_status = router.terminate()
    assert exit_status == 0
    assert chunks[-1].usage.completion_tokens == 150
    with pytest.raises(OSError):
        urllib.request.urlopen(router.url("/health"), timeout=5)
