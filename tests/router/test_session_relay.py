"""The router's per-step relay (Decode.Session, router/decode_stream.py)
with real pod processes, real routers and the official `openai` client.

Cluster (module scope): two colocated pods, one prefill and one decode pod;
a router over the colocated pods (requests of one session id stay on one
pod, so several share that pod's Session), one over the P/D pair.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.pods import start_pod
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4 5", "Hello there"]
LONG = 160  # output tokens of the streams that must finish
VICTIM = 3_000  # the cancelled stream's max_tokens: far longer than the others run


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    specs = [("colocated", {"block_size": 16, "num_blocks": 256}),
             ("colocated", {"block_size": 16, "num_blocks": 256}),
             ("prefill", {}), ("decode", {})]
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_pod, role, tiny_model_dir, **flags) for role, flags in specs]
        pods = [f.result() for f in futures]
    co_a, co_b, prefill, decode = pods
    routers = {}
    try:
        # a large epsilon: a session's requests all stay on its pod however uneven the load
        routers["co"] = start_router(tiny_model_dir, colocated=[co_a.address, co_b.address],
                                     session_epsilon=10)
        routers["pd"] = start_router(tiny_model_dir, prefill=[prefill.address],
                                     decode=[decode.address])
        for router in routers.values():
            wait_ready(router)
        yield {"co_a": co_a, "co_b": co_b, "prefill": prefill, "decode": decode, **routers}
    finally:
        for router in routers.values():
            router.terminate()
        for pod in pods:
            pod.kill()


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120)


def _load(pod) -> pb.LoadReport:
    with grpc.insecure_channel(pod.address) as channel:
        return pdserve_pb2_grpc.DecodeStub(channel).GetLoad(pb.LoadRequest(), timeout=10)


def _wait_load(pod, predicate, timeout: float = 30.0) -> pb.LoadReport:
    deadline = time.monotonic() + timeout
    while True:
        report = _load(pod)
        if predicate(report) or time.monotonic() > deadline:
            return report
        time.sleep(0.02)


def _stream(client, prompt: str, max_tokens: int, user: str | None = None,
            on_chunk=None) -> tuple[str, str | None]:
    """One streamed completion: (text, finish_reason)."""
    text, finish = [], None
    extra = {"ignore_eos": True}
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True, extra_body=extra,
                                       **({"user": user} if user else {}))
    with stream:
        for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if on_chunk is not None and on_chunk(len(text)) is False:
                return "".join(text), None  # leaving the `with` closes the connection
    return "".join(text), finish


def _reference(client, prompts: list[str], max_tokens: int) -> list[str]:
    """Undisturbed outputs, one request at a time."""
    return [_stream(client, p, max_tokens)[0] for p in prompts]


@pytest.mark.parametrize("path", ["co", "pd"])
def test_cancelling_one_request_frees_it_and_the_others_stream_on(cluster, path):
    router = cluster[path]
    pod = cluster["co_a" if path == "co" else "decode"]
    client = _client(router)
    others = PROMPTS[1:]
    reference = _reference(client, others, LONG)
    if path == "co":  # keep every stream on co_a (sessions stick to a pod)
        users = ["sticky"] * len(PROMPTS)
        pod = cluster["co_a"] if _first_pod(cluster, client) == "co_a" else cluster["co_b"]
    else:
        users = [None] * len(PROMPTS)
    idle = _wait_load(pod, lambda r: r.num_running == 0)
    assert idle.num_running == 0 and idle.num_free_blocks == idle.num_total_blocks

    all_started = threading.Barrier(len(PROMPTS))
    cancelled = threading.Event()
    freed: dict[str, pb.LoadReport] = {}

    def cancel_after_some(num_chunks: int):
        if num_chunks == 3:
            all_started.wait(timeout=60)
        if num_chunks < 8:
            return True
        # every stream is running on the pod now; close this one mid-stream
        running = _load(pod)
        freed["before"] = running
        return False

    def keep_going(num_chunks: int):
        if num_chunks == 3:
            all_started.wait(timeout=60)
        if cancelled.is_set() and "after" not in freed:
            freed["after"] = _wait_load(pod, lambda r: r.num_running == len(others), 10)
        return True

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        victim = pool.submit(_stream, client, PROMPTS[0], VICTIM, users[0], cancel_after_some)
        futures = [pool.submit(_stream, client, p, LONG, u, keep_going)
                   for p, u in zip(others, users[1:], strict=True)]
        text, finish = victim.result(timeout=120)
        cancelled.set()
        results = [f.result(timeout=120) for f in futures]

    assert finish is None and text  # the client left mid-stream
    assert freed["before"].num_running == len(PROMPTS)
    # the pod dropped the cancelled request while the others were still streaming
    assert freed["after"].num_running == len(others)
    assert [r[0] for r in results] == reference
    assert all(r[1] == "length" for r in results)
    done = _wait_load(pod, lambda r: r.num_running == 0
                      and r.num_free_blocks == r.num_total_blocks)
    assert done.num_running == 0 and done.num_free_blocks == done.num_total_blocks
    assert pod.metric_value("pdserve_aborts_total", reason="client") >= 1
    # a client leaving is a cancel, not a fault: nothing logged as one
    assert "Traceback" not in router.log_path.read_text(errors="replace")


def _first_pod(cluster, client) -> str:
    """Which colocated pod the "sticky" session lands on."""
    before = {name: _requests_seen(cluster[name]) for name in ("co_a", "co_b")}
    _stream(client, PROMPTS[0], 2, "sticky")
    after = {name: _requests_seen(cluster[name]) for name in ("co_a", "co_b")}
    return max(after, key=lambda name: after[name] - before[name])


def _requests_seen(pod) -> float:
    try:
        return pod.metric_value("pdserve_e2e_request_latency_seconds_count")
    except KeyError:
        return 0.0


def test_a_broken_session_moves_every_request_on_it(cluster, tiny_model_dir):
    """Kill the pod under a session with several streams: each request
    moves to the other pod and finishes exactly as an undisturbed run."""
    client = _client(cluster["co"])
    reference = _reference(client, PROMPTS, LONG)
    target = cluster[_first_pod(cluster, client)]
    migrations = cluster["co"].metric("pdserve_migrations_total")
    started = threading.Barrier(len(PROMPTS) + 1)

    def on_chunk(num_chunks: int):
        if num_chunks == 4:
            started.wait(timeout=60)
        return True

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(_stream, client, p, LONG, "sticky", on_chunk) for p in PROMPTS]
        started.wait(timeout=60)
        assert _load(target).num_running == len(PROMPTS)  # all on one pod's session
        target.kill()
        results = [f.result(timeout=120) for f in futures]
    assert [r[0] for r in results] == reference
    assert all(r[1] == "length" for r in results)
    assert cluster["co"].metric("pdserve_migrations_total") - migrations == len(PROMPTS)


def _unstreamed(client, prompt: str, max_tokens: int) -> str:
    """The same completion without `stream`: no direct relay on its way."""
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True}
                                     ).choices[0].text


@pytest.mark.parametrize("path", ["co", "pd"])
def test_streams_the_direct_relay_writes_equal_the_unstreamed_output(cluster, path):
    router = cluster[path]
    client = _client(router)
    before = router.metric("pdserve_router_direct_relayed_tokens_total")
    for prompt in PROMPTS[:2]:
        text, finish = _stream(client, prompt, LONG)
        assert (text, finish) == (_unstreamed(client, prompt, LONG), "length")
    # all but a stream's first decode delta and its last go the direct way
    # when nothing else runs; allow for a busy machine
    assert router.metric("pdserve_router_direct_relayed_tokens_total") - before >= LONG


def test_a_client_that_stops_reading_gets_its_whole_stream_exactly(cluster):
    """The client's socket fills (a small receive buffer, nothing read until
    the pod has generated everything): the relay leaves the rest to the
    request's task, whose writes wait for the socket, and the client still
    reads the exact stream."""
    router, num_tokens = cluster["pd"], 1_500
    expected = _unstreamed(_client(router), PROMPTS[2], num_tokens)
    before = router.metric("pdserve_router_direct_relayed_tokens_total")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", router.http_port))
    connection = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=120)
    connection.sock = sock
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": num_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    connection.request("POST", "/v1/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Transfer-Encoding") == "chunked"
    _wait_load(cluster["decode"], lambda r: r.num_running == 1, 30)
    _wait_load(cluster["decode"], lambda r: r.num_running == 0, 90)  # all generated
    text, finish = [], None
    for line in response.read().decode().splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[len("data: "):])["choices"][0]
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
    connection.close()
    assert ("".join(text), finish) == (expected, "length")
    # the relay stood aside once the socket was full
    assert router.metric("pdserve_router_direct_relayed_tokens_total") - before < num_tokens - 2
