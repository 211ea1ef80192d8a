"""Routing end to end: real pods, real `pdserve router` processes, a real redis-server.

Which prefill pod served a request is read from that pod's own metrics
(`pdserve_time_to_first_token_seconds_count{role="prefill"}`, observed before
the Prefill RPC returns), so every assertion is about where work really ran.
Session mappings shared by router replicas are read from Redis itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.integration.pods import PodProcess, start_pod
from tests.redis_server import RedisServer
from tests.router.routers import RouterProcess, start_router

pytestmark = pytest.mark.slow

SERVED = "pdserve_time_to_first_token_seconds_count"
POD_FLAGS = {"num_blocks": 512}


def start_pods(model_dir: Path, roles: list[str], **flags: object) -> list[PodProcess]:
    with ThreadPoolExecutor(len(roles)) as pool:
        futures = [pool.submit(start_pod, role, model_dir, **POD_FLAGS, **flags)
                   for role in roles]
        return [f.result() for f in futures]


def served_counts(pods: list[PodProcess]) -> dict[str, float]:
    return {p.address: p.metric_value(SERVED, role="prefill") for p in pods}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {a: after[a] - before.get(a, 0.0) for a in after if after[a] != before.get(a, 0.0)}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """3 prefill pods, 1 decode pod, 2 router replicas sharing one redis-server."""
    redis_server = RedisServer(tmp_path_factory.mktemp("redis-int"))
    pods: list[PodProcess] = []
    routers: list[RouterProcess] = []
    try:
        pods = start_pods(tiny_model_dir, ["prefill", "prefill", "prefill", "decode"])
        prefill, decode = pods[:3], pods[3:]
        for _ in range(2):
            # no session-answer warm-ups: the tests count each prefill pod's requests
            routers.append(start_router(
                tiny_model_dir, prefill=[p.address for p in prefill],
                decode=[d.address for d in decode], redis_url=redis_server.url,
                extra=["--no-warm-session-answers"]))
        yield {"prefill": prefill, "decode": decode, "routers": routers, "redis": redis_server}
    finally:
        for router in routers:
            router.terminate()
        for pod in pods:
            pod.kill()
        redis_server.stop()


@pytest.mark.timeout(120)
def test_one_session_sticks_to_one_pod_and_sessions_spread(cluster: dict) -> None:
    prefill, (r1, r2) = cluster["prefill"], cluster["routers"]
    before = served_counts(prefill)
    for i in range(50):
        # both replicas, different prompts: only the session decides
        (r1 if i % 2 else r2).complete(f"request {i} of a long chat", session="sticky-user")
    moved = delta(before, served_counts(prefill))
    assert list(moved.values()) == [50.0], moved
    (pod,) = moved
    client = cluster["redis"].client()
    assert client.get("pdserve:session:prefill:sticky-user") == pod
    client.close()

    before = served_counts(prefill)
    for i in range(30):
        r1.complete("same prompt for every session", session=f"user-{i}")
    spread = delta(before, served_counts(prefill))
    assert sum(spread.values()) == 30.0
    assert len(spread) == 3, spread  # every pod got some sessions
    assert max(spread.values()) <= 20, spread


@pytest.mark.timeout(120)
def test_two_router_replicas_route_each_session_to_the_same_pod(cluster: dict) -> None:
    prefill, (r1, r2) = cluster["prefill"], cluster["routers"]
    client = cluster["redis"].client()
    for i in range(12):
        session = f"replica-session-{i}"
        seen = []
        for router in (r1, r2, r1):
            before = served_counts(prefill)
            router.complete(f"turn of {session}", session=session)
            (pod,) = delta(before, served_counts(prefill))
            seen.append(pod)
        assert len(set(seen)) == 1, (session, seen)
        assert client.get(f"pdserve:session:prefill:{session}") == seen[0]
    client.close()


@pytest.mark.timeout(120)
def test_overloaded_pod_sheds_a_session_and_the_new_mapping_sticks(cluster: dict) -> None:
    """Flood the session's pod with long prompts sent to it directly (so its
    queue fills and its LoadReport shows it); the session's next request
    moves to another pod, and the new mapping holds after the flood."""
    prefill, (r1, _) = cluster["prefill"], cluster["routers"]
    client = cluster["redis"].client()
    r1.complete("establish", session="hot-user")
    home = client.get("pdserve:session:prefill:hot-user")
    stop = threading.Event()

    def flood(worker: int) -> None:
        with grpc.insecure_channel(home) as channel:
            stub = pdserve_pb2_grpc.PrefillStub(channel)
            n = 0
            while not stop.is_set():
                n += 1
                list(stub.Prefill(pdserve_pb2.PrefillRequest(
                    request_id=f"flood-{worker}-{n}",
                    prompt_token_ids=[(worker * 7919 + n * 31 + i) % 1000 + 5
                                      for i in range(2000)],
                    sampling=pdserve_pb2.SamplingParams(max_tokens=1, top_p=1.0),
                ), timeout=60))

    threads = [threading.Thread(target=flood, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    try:
        moved_to = None
        deadline = time.monotonic() + 30
        while moved_to is None and time.monotonic() < deadline:
            time.sleep(0.2)
            r1.complete("hot user's next turn", session="hot-user")
            current = client.get("pdserve:session:prefill:hot-user")
            if current != home:
                moved_to = current
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert moved_to is not None, "the session never left its overloaded pod"
    assert moved_to in {p.address for p in prefill} - {home}
    for _ in range(5):
        before = served_counts(prefill)
        r1.complete("after the flood", session="hot-user")
        assert list(delta(before, served_counts(prefill))) == [moved_to]
    client.close()


@pytest.mark.timeout(180)
def test_redis_registry_new_pod_gets_traffic_and_dead_pod_leaves(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    redis_server = RedisServer(tmp_path_factory.mktemp("redis-reg"))
    pods: list[PodProcess] = []
    router = None
    try:
        pods = start_pods(tiny_model_dir, ["prefill", "decode"], redis_url=redis_server.url)
        router = start_router(tiny_model_dir, redis_url=redis_server.url)
        router.complete("hello")
        assert router.healthy_pods() == {"prefill": 1, "decode": 1, "colocated": 0}
        # a new prefill pod registers itself and gets traffic within seconds
        (newcomer,) = start_pods(tiny_model_dir, ["prefill"], redis_url=redis_server.url)
        pods.append(newcomer)
        joined_at = time.monotonic()
        before = newcomer.metric_value(SERVED, role="prefill")
        i = 0
        while newcomer.metric_value(SERVED, role="prefill") == before:
            assert time.monotonic() - joined_at < 10, "new pod got no traffic within 10 s"
            router.complete("spread me", session=f"s{i}")
            i += 1
        # kill -9 the first prefill pod: requests keep succeeding
        client = redis_server.client()
        dead_key = f"pdserve:pods:prefill:{pods[0].address}"
        assert client.exists(dead_key) == 1
        assert router.healthy_pods()["prefill"] == 2
        pods[0].kill()
        killed_at = time.monotonic()
        for j in range(20):
            result = router.complete("still served", session=f"after-kill-{j}")
            assert result["choices"][0]["finish_reason"] in ("length", "stop")
        # the router stopped using it at its first failed poll (0.2 s here) ...
        assert router.healthy_pods()["prefill"] == 1
        # ... and its heartbeat key expires within the TTL (6 s)
        while client.exists(dead_key):
            assert time.monotonic() - killed_at < 8, "dead pod's key outlived its TTL"
            time.sleep(0.2)
        client.close()
    finally:
        if router is not None:
            router.terminate()
        for pod in pods:
            pod.kill()
        redis_server.stop()
