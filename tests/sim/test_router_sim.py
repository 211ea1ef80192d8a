"""A real router serves OpenAI requests through simulated pods, learns their
prefix caches from their KV events, and survives a quarter of 200 simulated
pods disappearing at once.

The router is a real `pdserve router` process (tests/router/routers.py);
the pods are simulated ones on real loopback gRPC (tests/sim/cluster_thread.py),
registered in the module's real redis-server (tests/conftest.py), so the
router finds them exactly as it finds real pods.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import openai
import pytest

from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.block_hash import extend_block_hashes
from router.routing.rendezvous import prefix_key, rank
from tests.redis_server import RedisServer
from tests.router.routers import RouterProcess, start_router
from tests.sim.cluster_thread import ClusterThread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CACHE_AWARE = ["--routing-policy", "cache-aware"]


def prompt(seed: int, length: int = 100) -> list[int]:
    return [(seed * 7919 + i * 131) % 900 + 20 for i in range(length)]


def complete(router: RouterProcess, token_ids: list[int], max_tokens: int = 4
             ) -> tuple[int, dict]:
    """(HTTP status, body) of one /v1/completions call."""
    body = json.dumps({"model": "tiny", "prompt": token_ids, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{router.base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.05)


def index_blocks(router: RouterProcess, address: str) -> float:
    with urllib.request.urlopen(f"{router.base_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(f'pdserve_router_cache_index_blocks{{pod="{address}"}}'):
            return float(line.rpartition(" ")[2])
    return 0.0


@pytest.fixture(scope="module")
def small(tiny_model_dir, redis_server) -> Iterator[dict]:
    """2 simulated prefill pods and 1 decode pod, a cache-aware router."""
    cluster = ClusterThread(tiny_model_dir, "--prefill", "2", "--decode", "1",
                            "--prefill-num-blocks", "256", "--decode-num-blocks", "64",
                            "--redis-url", redis_server.url)
    router = None
    try:
        router = start_router(tiny_model_dir, redis_url=redis_server.url, extra=CACHE_AWARE)
        yield {"cluster": cluster, "router": router}
    finally:
        if router is not None:
            router.terminate()
        cluster.stop()


def test_openai_clients_are_served_through_simulated_pods(small):
    client = openai.OpenAI(base_url=f"{small['router'].base_url}/v1", api_key="x")
    completion = client.completions.create(model="tiny", prompt="hello there", max_tokens=7)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 7
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_kv_events_carry_the_engines_block_hashes_and_steer_the_router(small):
    cluster, router = small["cluster"], small["router"]
    prefill = cluster.addresses()["prefill"]
    shared = prompt(1)
    holder = rank(prefix_key(shared, 64), prefill)[-1]  # not the first-tokens hash's choice
    with grpc.insecure_channel(holder) as channel:
        events = pdserve_pb2_grpc.CacheEventsStub(channel).Subscribe(
            pdserve_pb2.CacheEventsRequest(), timeout=30)
        assert next(events).snapshot
        list(pdserve_pb2_grpc.PrefillStub(channel).Prefill(pdserve_pb2.PrefillRequest(
            request_id="warm-1", prompt_token_ids=shared,
            sampling=pdserve_pb2.SamplingParams(max_tokens=1, top_p=1.0)), timeout=30))
        batch = next(events)
        events.cancel()
    expected: list[int] = []
    extend_block_hashes(expected, shared, 16)
    assert list(batch.stored) == expected and batch.block_size == 16
    wait_for(lambda: index_blocks(router, holder) >= len(expected),
             f"the router never learnt the {len(expected)} blocks of {holder}")
    time.sleep(1.0)  # five load polls: the warm-up's load must not put the holder over the bound
    status, body = complete(router, shared + [3])
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96


def test_a_router_survives_50_of_200_pods_disappearing_at_once(tiny_model_dir, tmp_path):
    redis_server = RedisServer(tmp_path)  # its own: the small cluster's pods stay registered
    cluster = ClusterThread(tiny_model_dir, "--prefill", "50", "--decode", "150",
                            "--prefill-num-blocks", "64", "--decode-num-blocks", "16",
                            "--redis-url", redis_server.url, "--grace-period", "5")
    router = None
    try:
        router = start_router(tiny_model_dir, redis_url=redis_server.url, poll_interval=1.0)
        wait_for(lambda: router.healthy_pods() == {"prefill": 50, "decode": 150,
                                                   "colocated": 0},
                 "the router never saw the 200 pods", timeout=60)
        addresses = cluster.addresses()
        gone = {"drained": addresses["prefill"][:12] + addresses["decode"][:13],
                "killed": addresses["prefill"][12:25] + addresses["decode"][13:25]}
        results: list[list[tuple[int, str]]] = []  # per request: its attempts
        lock = threading.Lock()
        started = threading.Barrier(9)

        def client(index: int) -> None:
            started.wait()
            for i in range(8):
                attempts = []
                for attempt in range(3):  # the client's retries after a clear error
                    if attempt:  # within a poll interval the router learns a pod is gone
                        time.sleep(1.0)
                    status, body = complete(router, prompt(index * 100 + i, 40), max_tokens=6)
                    attempts.append((status, body.get("error", {}).get("message", "")))
                    if status == 200:
                        assert body["usage"]["completion_tokens"] == 6
                        break
                with lock:
                    results.append(attempts)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        started.wait()
        time.sleep(1.0)
        cluster.drain(gone["drained"])
        cluster.kill(gone["killed"])
        for thread in threads:
            thread.join(120)
        assert len(results) == 8 * 8
        lost = [a for a in results if a[-1][0] != 200]
        assert not lost, f"requests that never succeeded: {lost[:5]}\n{router.log_tail()}"
        unclear = [(s, m) for a in results for s, m in a if s != 200 and not m]
        assert not unclear, f"errors without a message: {unclear[:5]}"
        wait_for(lambda: router.healthy_pods() == {"prefill": 25, "decode": 125,
                                                   "colocated": 0},
                 "the router still counts pods that are gone", timeout=30)
        gone_set = {a for group in gone.values() for a in group}
        survivors = [cluster.pod(a) for role in ("prefill", "decode")
                     for a in addresses[role] if a not in gone_set]

        def held() -> list[str]:
            return [pod.address for pod in survivors
                    if pod.loop.stats.num_reserved or pod.loop.stats.num_running
                    or pod.loop.stats.num_waiting
                    or pod.loop.stats.num_free_blocks != pod.loop.stats.num_total_blocks]
        wait_for(lambda: not cluster.on_loop(held), "pods still hold reservations or blocks")
    finally:
        if router is not None:
            router.terminate()
        cluster.stop()
        redis_server.stop()
