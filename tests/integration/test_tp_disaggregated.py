"""Disaggregated serving between pods of different tensor-parallel sizes
(real processes, gloo, the tiny model: 2 KV heads), through the router and
the openai client:

* prefill TP=2 -> decode TP=1 (the decode pod gathers its heads from both
  prefill ranks) and prefill TP=1 -> decode TP=2 (the prefill pod's heads
  split across both decode ranks) give the greedy text of a colocated TP=1
  pod, on prompts across several decode blocks;
* kill -9 of a decode pod's rank 1 mid-stream: the pod goes down whole, and
  every stream finishes token-identical on the other decode pod (migration)
  or fails with a clear error; nothing hangs;
* a prefill pod whose KV layout differs (another dtype) is refused at the
  handshake: the request fails with a message naming both layouts, or is
  served exactly by a retry elsewhere -- the decode cache never takes its KV.

Byte-level checks (each decode rank receives exactly the heads the prefill
ranks computed for it; total bytes equal TP=1's) are in the kv_transfer,
decode_service and prefill_service tests.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.pods import start_pods
from tests.integration.test_tensor_parallel import _alive, _children, _generate
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

PROMPTS = ("The capital of France is", "Count with me: one, two, three,",
           "A long story about a lighthouse keeper " * 40)  # ~320 tokens: 3 decode blocks
POD = {"num_blocks": 512}
DECODE = {**POD, "block_size": 128}
# Every prompt takes the whole P/D path: no split prefill, no decode pod
# prefilling a prompt itself.
PD_ONLY = {"split_prefill_min_tokens": 0, "local_prefill_max_tokens": 0}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    pods = start_pods({
        "reference": ("colocated", POD),
        "prefill_tp2": ("prefill", {**POD, "tensor_parallel_size": 2}),
        "prefill_tp1": ("prefill", POD),
        "decode_tp1": ("decode", DECODE),
        "decode_tp2": ("decode", {**DECODE, "tensor_parallel_size": 2}),
    }, tiny_model_dir)
    routers = {}
    try:
        routers["reference"] = start_router(tiny_model_dir, colocated=[pods["reference"].address])
        routers["p2_d1"] = start_router(tiny_model_dir, prefill=[pods["prefill_tp2"].address],
                                        decode=[pods["decode_tp1"].address], **PD_ONLY)
        routers["p1_d2"] = start_router(tiny_model_dir, prefill=[pods["prefill_tp1"].address],
                                        decode=[pods["decode_tp2"].address], **PD_ONLY)
        for router in routers.values():
            wait_ready(router)
        yield pods, routers
    finally:
        for router in routers.values():
            router.terminate()
        for pod in pods.values():
            pod.kill()


def _texts(router, max_tokens: int = 24) -> list[str]:
    client = openai.OpenAI(base_url=router.base_url, api_key="-")
    return [client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0).choices[0].text for prompt in PROMPTS]


@pytest.mark.parametrize("path", ["p2_d1", "p1_d2"])
def test_different_tp_sizes_give_the_colocated_tp1_text(stack, path: str) -> None:
    pods, routers = stack
    expected = _texts(routers["reference"])
    assert all(expected)
    assert _texts(routers[path]) == expected
    # the decode pod served them from transferred KV, not by prefilling itself
    decode = pods["decode_tp1" if path == "p2_d1" else "decode_tp2"]
    with grpc.insecure_channel(decode.address) as channel:
        load = pdserve_pb2_grpc.DecodeStub(channel).GetLoad(pb.LoadRequest(), timeout=10)
    assert load.tensor_parallel_size == (1 if path == "p2_d1" else 2)
    assert routers[path].metric("pdserve_router_local_prefills_total") == 0
    assert routers[path].metric("pdserve_router_split_prefills_total") == 0


def test_killing_a_decode_pods_rank_1_mid_stream_moves_its_streams(tiny_model_dir) -> None:
    pods = start_pods({"prefill": ("prefill", POD),
                       "decode_tp2": ("decode", {**DECODE, "tensor_parallel_size": 2}),
                       "decode_tp1": ("decode", DECODE),
                       "reference": ("colocated", POD)}, tiny_model_dir)
    routers = []
    try:
        reference = start_router(tiny_model_dir, colocated=[pods["reference"].address])
        routers.append(reference)
        # The TP=1 decode pod is frozen until the router stops routing to it,
        # so both streams start on the TP=2 one, and thawed before the kill.
        both = start_router(tiny_model_dir, max_migrations=2, **PD_ONLY,
                            prefill=[pods["prefill"].address],
                            decode=[pods["decode_tp2"].address, pods["decode_tp1"].address])
        routers.append(both)
        wait_ready(reference)
        wait_ready(both)
        num_tokens = 1200
        expected = {p: _generate(reference, p, num_tokens) for p in PROMPTS[:2]}
        pods["decode_tp1"].process.send_signal(signal.SIGSTOP)
        results: dict[str, list[int] | BaseException] = {}
        progress = {p: [0] for p in PROMPTS[:2]}

        def run(prompt: str) -> None:
            try:
                results[prompt] = _generate(both, prompt, num_tokens, progress[prompt])
            except BaseException as exc:  # recorded: a clear error is an allowed outcome
                results[prompt] = exc

        try:
            _wait_healthy_decode(both, 1)
            threads = [threading.Thread(target=run, args=(p,), daemon=True)
                       for p in PROMPTS[:2]]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 90
            while min(p[0] for p in progress.values()) < 10:
                assert time.monotonic() < deadline, f"the streams did not start: {results}"
                time.sleep(0.05)
        finally:
            pods["decode_tp1"].process.send_signal(signal.SIGCONT)
        _wait_healthy_decode(both, 2)
        (worker,) = _children(pods["decode_tp2"].process.pid)
        os.kill(worker, signal.SIGKILL)
        for thread in threads:
            thread.join(180)
            assert not thread.is_alive(), "a stream hung after the kill"
        for prompt in PROMPTS[:2]:
            got = results[prompt]
            if isinstance(got, BaseException):
                assert isinstance(got, grpc.RpcError), repr(got)
                assert got.code() is grpc.StatusCode.UNAVAILABLE, got
            else:
                assert got == expected[prompt]  # exact: no duplicates or gaps
        assert any(not isinstance(r, BaseException) for r in results.values()), results
        assert both.metric("pdserve_migrations_total") >= 1
        assert pods["decode_tp2"].process.wait(30) != 0  # the pod went down whole
        assert not _alive(worker)
    finally:
        for router in routers:
            router.terminate()
        for pod in pods.values():
            pod.kill()


def _wait_healthy_decode(router, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(router.url("/ready"), timeout=5) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        if json.loads(body)["healthy_pods"]["decode"] == count:
            return
        assert time.monotonic() < deadline, f"the router never saw {count} healthy decode pods"
        time.sleep(0.05)


def test_a_prefill_pod_with_another_layout_is_refused_at_the_handshake(tiny_model_dir) -> None:
    pods = start_pods({"prefill_bf16": ("prefill", {**POD, "tensor_parallel_size": 2,
                                                    "dtype": "bfloat16"}),
                       "decode_tp2": ("decode", {**DECODE, "tensor_parallel_size": 2})},
                      tiny_model_dir)
    router = None
    try:
        router = start_router(tiny_model_dir, prefill=[pods["prefill_bf16"].address],
                              decode=[pods["decode_tp2"].address], **PD_ONLY)
        wait_ready(router)
        client = openai.OpenAI(base_url=router.base_url, api_key="-", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                      temperature=0)
        message = str(caught.value)
        assert "layout" in message and "bfloat16" in message and "float32" in message, message
        # nothing was injected: the decode pod holds no request and all its blocks are free
        with grpc.insecure_channel(pods["decode_tp2"].address) as channel:
            load = pdserve_pb2_grpc.DecodeStub(channel).GetLoad(pb.LoadRequest(), timeout=10)
        assert load.num_running == 0
        assert load.num_free_blocks == load.num_total_blocks
    finally:
        if router is not None:
            router.terminate()
        for pod in pods.values():
            pod.kill()
