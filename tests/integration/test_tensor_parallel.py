"""A colocated pod at tensor_parallel_size 2 behind the router (real
processes, gloo, the tiny model): the openai client gets the text a TP=1
pod gives, and kill -9 of its rank 1 mid-stream takes the whole pod down
while every stream finishes token-identical on the other pod (migration)
or fails with a clear error; nothing hangs.

The sharded forward's tolerance against TP=1 and the engine-level greedy
parity on the base model across 128-token blocks are in
tests/engine/parallel/; this is the serving path around them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.pods import start_pods
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ("The capital of France is", "Count with me: one, two, three,",
           "A long story about a lighthouse keeper " * 12)


def _children(pid: int) -> list[int]:
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        pids.extend(int(p) for p in text)
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _running(pod) -> int:
    with grpc.insecure_channel(pod.address) as channel:
        stub = pdserve_pb2_grpc.DecodeStub(channel)
        return stub.GetLoad(pb.LoadRequest(), timeout=10).num_running


def _generate(router, prompt: str, max_tokens: int, progress: list[int] | None = None
              ) -> list[int]:
    tokens: list[int] = []
    with grpc.insecure_channel(router.grpc_address) as channel:
        request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
        for message in pdserve_pb2_grpc.RouterStub(channel).Generate(request, timeout=120):
            tokens.extend(message.token_ids)
            if progress is not None:
                progress[0] = len(tokens)
    return tokens


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    pods = start_pods({"tp2": ("colocated", {"tensor_parallel_size": 2, "num_blocks": 512}),
                       "tp1": ("colocated", {"num_blocks": 512})}, tiny_model_dir)
    routers = {}
    try:
        routers["tp2"] = start_router(tiny_model_dir, colocated=[pods["tp2"].address])
        routers["tp1"] = start_router(tiny_model_dir, colocated=[pods["tp1"].address])
        routers["both"] = start_router(tiny_model_dir, max_migrations=2,
                                       colocated=[pods["tp2"].address, pods["tp1"].address])
        for router in routers.values():
            wait_ready(router)
        yield pods, routers
    finally:
        for router in routers.values():
            router.terminate()
        for pod in pods.values():
            pod.kill()


def test_a_tp2_pod_answers_the_openai_client_as_a_tp1_pod_does(stack) -> None:
    pods, routers = stack
    texts = {}
    for name in ("tp2", "tp1"):
        client = openai.OpenAI(base_url=routers[name].base_url, api_key="-")
        texts[name] = [client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
            for prompt in PROMPTS]
    assert texts["tp2"] == texts["tp1"]
    assert all(texts["tp1"])
    # the pod reports its size; its rank 1 is a child process of it
    with grpc.insecure_channel(pods["tp2"].address) as channel:
        load = pdserve_pb2_grpc.DecodeStub(channel).GetLoad(pb.LoadRequest(), timeout=10)
    assert load.tensor_parallel_size == 2
    assert len(_children(pods["tp2"].process.pid)) == 1


def _healthy_colocated(router) -> int:
    """The router's count of healthy colocated pods (GET /ready; 503 carries it too)."""
    try:
        with urllib.request.urlopen(router.url("/ready"), timeout=5) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    return json.loads(body)["healthy_pods"]["colocated"]


def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_killing_rank_1_mid_stream_takes_the_pod_down_and_streams_move(stack) -> None:
    pods, routers = stack
    num_tokens = 1500
    expected = {p: _generate(routers["tp1"], p, num_tokens) for p in PROMPTS[:2]}
    results: dict[str, list[int] | BaseException] = {}
    progress = {p: [0] for p in PROMPTS[:2]}

    def run(prompt: str) -> None:
        try:
            results[prompt] = _generate(routers["both"], prompt, num_tokens, progress[prompt])
        except BaseException as exc:  # recorded: a clear error is an allowed outcome
            results[prompt] = exc

    # Both streams start on the TP=2 pod: the TP=1 pod is frozen until the
    # router stops routing to it, and thawed (and healthy again) before the kill,
    # so the streams have somewhere to move.
    both = routers["both"]
    pods["tp1"].process.send_signal(signal.SIGSTOP)
    try:
        _wait(lambda: _healthy_colocated(both) == 1, "the router kept the frozen pod")
        threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in PROMPTS[:2]]
        for thread in threads:
            thread.start()
        _wait(lambda: min(p[0] for p in progress.values()) >= 10, "the streams did not start",
              60)
    finally:
        pods["tp1"].process.send_signal(signal.SIGCONT)
    _wait(lambda: _healthy_colocated(both) == 2, "the thawed pod did not come back")
    assert _running(pods["tp2"]) == 2
    (worker,) = _children(pods["tp2"].process.pid)
    os.kill(worker, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a stream hung after the kill"
    for prompt in PROMPTS[:2]:
        got = results[prompt]
        if isinstance(got, BaseException):  # allowed only as a clear error
            assert isinstance(got, grpc.RpcError), repr(got)
            assert got.code() is grpc.StatusCode.UNAVAILABLE, got
        else:
            assert got == expected[prompt]  # exact, no duplicates or gaps
    assert any(not isinstance(r, BaseException) for r in results.values()), results
    assert both.metric("pdserve_migrations_total") >= 1
    # the pod went down whole, and no rank outlived it
    assert pods["tp2"].process.wait(30) != 0
    assert not _alive(worker)
    assert _running(pods["tp1"]) == 0  # the TP=1 pod served the moved streams and is serving
