"""Cache-aware routing end to end: real prefill and decode pods publishing
their prefix-cache events through a real redis-server to two real `pdserve
router --routing-policy cache-aware` replicas.

Which prefill pod served a request is read from the pods' own metrics (as in
test_routing_integration.py); what a router's prefix index holds, from its
`pdserve_router_cache_index_blocks{pod=...}` gauge. Every prefix is placed on
the pod the first-tokens hash would NOT choose, so only the cache events can
send a request there.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.registry import CACHE_EVENTS_CHANNEL
from router.cache_index.index import PromptBlocks
from router.routing.rendezvous import prefix_key, rank
from tests.integration.pods import PodProcess, start_pod
from tests.redis_server import RedisServer, free_port
from tests.router.routers import RouterProcess, start_router

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SERVED = "pdserve_time_to_first_token_seconds_count"
CACHE_AWARE = ["--routing-policy", "cache-aware"]


def prompt(seed: int, length: int = 100) -> list[int]:
    return [(seed * 7919 + i * 131) % 900 + 20 for i in range(length)]


def served(pods: list[PodProcess]) -> dict[str, float]:
    return {p.address: p.metric_value(SERVED, role="prefill") for p in pods}


def served_by(pods: list[PodProcess], send) -> tuple[str, dict]:
    before = served(pods)
    result = send()
    after = served(pods)
    (address,) = [a for a in after if after[a] != before[a]]
    return address, result


def complete(router: RouterProcess, token_ids: list[int], max_tokens: int = 4) -> dict:
    body = json.dumps({"model": "tiny", "prompt": token_ids, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{router.base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def index_blocks(router: RouterProcess, address: str) -> float:
    with urllib.request.urlopen(f"{router.base_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(f'pdserve_router_cache_index_blocks{{pod="{address}"}}'):
            return float(line.rpartition(" ")[2])
    return 0.0


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.05)


def prefill_directly(pod: PodProcess, token_ids: list[int], request_id: str) -> None:
    """Prefill-only on one pod (no KV target): its prefix cache now holds the prompt."""
    with grpc.insecure_channel(pod.address) as channel:
        list(pdserve_pb2_grpc.PrefillStub(channel).Prefill(pdserve_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=token_ids,
            sampling=pdserve_pb2.SamplingParams(max_tokens=1, top_p=1.0)), timeout=30))


def wait_idle_in_routers_view(pod: PodProcess, poll_interval: float = 0.5) -> None:
    """The pod has nothing queued or running, and the routers have polled it
    since: a load left over from a warm-up would put it over the load bound."""
    def idle() -> bool:
        with grpc.insecure_channel(pod.address) as channel:
            load = pdserve_pb2_grpc.PrefillStub(channel).GetLoad(pdserve_pb2.LoadRequest(),
                                                                 timeout=5)
        return load.num_waiting == 0 and load.num_running == 0
    wait_for(idle, f"{pod.address} never went idle")
    time.sleep(3 * poll_interval)  # three of the routers' load polls


def generation(pod: PodProcess) -> int:
    with grpc.insecure_channel(pod.address) as channel:
        return pdserve_pb2_grpc.PrefillStub(channel).GetLoad(pdserve_pb2.LoadRequest(),
                                                             timeout=5).generation


def not_first_choice(token_ids: list[int], pods: list[PodProcess]) -> PodProcess:
    last = rank(prefix_key(token_ids, 64), [p.address for p in pods])[-1]
    return next(p for p in pods if p.address == last)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """2 prefill pods (fixed ports, so one can restart at its address) and a
    decode pod, all publishing to one redis-server; 2 cache-aware routers."""
    redis_server = RedisServer(tmp_path_factory.mktemp("redis-cache"))
    pods: list[PodProcess] = []
    routers: list[RouterProcess] = []
    ports = [free_port(), free_port()]
    try:
        pods = [start_pod("prefill", tiny_model_dir, port=port, num_blocks=256,
                          redis_url=redis_server.url) for port in ports]
        pods.append(start_pod("decode", tiny_model_dir, num_blocks=256))
        for _ in range(2):
            routers.append(start_router(
                tiny_model_dir, prefill=[p.address for p in pods[:2]],
                decode=[pods[2].address], redis_url=redis_server.url, extra=CACHE_AWARE))
        yield {"prefill": pods[:2], "decode": pods[2], "routers": routers, "pods": pods,
               "redis": redis_server, "ports": ports, "model": tiny_model_dir}
    finally:
        for router in routers:
            router.terminate()
        for pod in pods:
            pod.kill()
        redis_server.stop()


def test_events_through_redis_reach_both_routers_and_steer_a_repeated_prefix(cluster):
    prefill, routers = cluster["prefill"], cluster["routers"]
    client = redis.Redis.from_url(cluster["redis"].url)
    wait_for(lambda: client.pubsub_numsub(CACHE_EVENTS_CHANNEL)[0][1] == 2,
             "both routers never subscribed to the events channel")
    client.close()
    shared = prompt(1)
    holder = not_first_choice(shared, prefill)
    prefill_directly(holder, shared, "warm-1")
    blocks = len(PromptBlocks(shared + [0]).hashes(16))
    for router in routers:
        wait_for(lambda r=router: index_blocks(r, holder.address) >= blocks,
                 f"router never learnt the {blocks} blocks of {holder.address}")
    for i, router in enumerate(routers * 2):
        # the other router's last request must not show as the holder's queue
        # in this router's (polled) view: the load bound would rightly skip it
        wait_idle_in_routers_view(holder)
        address, result = served_by(prefill, lambda r=router, i=i: complete(r, shared + [i]))
        assert address == holder.address, i
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96


def test_restarted_pod_entries_are_gone(cluster):
    prefill, routers = cluster["prefill"], cluster["routers"]
    shared = prompt(2)
    holder = not_first_choice(shared, prefill)
    prefill_directly(holder, shared, "warm-2")
    for router in routers:
        wait_for(lambda r=router: index_blocks(r, holder.address) >= 6, "blocks learnt")
    old_generation = generation(holder)
    holder.kill()
    index = prefill.index(holder)
    restarted = start_pod("prefill", cluster["model"], port=cluster["ports"][index],
                          num_blocks=256, redis_url=cluster["redis"].url)
    prefill[index] = restarted
    cluster["pods"][index] = restarted  # the fixture stops it
    assert generation(restarted) != old_generation
    for router in routers:
        wait_for(lambda r=router: index_blocks(r, restarted.address) == 0
                 and r.healthy_pods()["prefill"] == 2,
                 "the restarted pod's old entries were not dropped")
    # nobody caches the prompt now: it goes where the first-tokens ranking says
    first = rank(prefix_key(shared, 64), [p.address for p in prefill])[0]
    address, _ = served_by(prefill, lambda: complete(routers[0], shared + [1]))
    assert address == first != restarted.address


def test_a_late_router_and_false_events_still_answer_correctly(cluster, tiny_model_dir):
    prefill, routers = cluster["prefill"], cluster["routers"]
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), dtype="float32",
                                    num_blocks=64))
    greedy = SamplingParams(temperature=0.0, max_tokens=4)

    def reference(token_ids: list[int]) -> str:
        return engine.generate([token_ids], greedy)[0].text

    # a late router missed every event so far (pub/sub keeps no history): it
    # starts from each pod's snapshot, and answers right either way
    shared = prompt(3)
    holder = not_first_choice(shared, prefill)
    prefill_directly(holder, shared, "warm-3")
    for router in routers:
        wait_for(lambda r=router: index_blocks(r, holder.address) >= 6, "blocks learnt")
    late = start_router(tiny_model_dir, prefill=[p.address for p in prefill],
                        decode=[cluster["decode"].address], redis_url=cluster["redis"].url,
                        extra=CACHE_AWARE)
    try:
        wait_for(lambda: index_blocks(late, holder.address) >= 6, "the late router's snapshot")
        address, result = served_by(prefill, lambda: complete(late, shared + [5]))
        assert address == holder.address
        assert result["choices"][0]["text"] == reference(shared + [5])
        # events it never had the truth of: a batch claiming a pod holds a prompt
        # it never computed (as if its evictions had been missed)
        fake = prompt(4)
        liar = not_first_choice(fake, prefill)
        client = redis.Redis.from_url(cluster["redis"].url)
        client.publish(CACHE_EVENTS_CHANNEL, pdserve_pb2.CacheEventBatch(
            address=liar.address, role="prefill", generation=generation(liar), block_size=16,
            sequence=10**6, stored=PromptBlocks(fake).hashes(16)).SerializeToString())
        client.close()
        cached = []
        for router in (*routers, late):
            wait_for(lambda r=router: index_blocks(r, liar.address) >= 6, "fake blocks learnt")
            wait_idle_in_routers_view(liar)  # the previous router's request is over
            address, result = served_by(prefill, lambda r=router: complete(r, fake))
            assert address == liar.address  # routed by the wrong belief ...
            assert result["choices"][0]["text"] == reference(fake)  # ... answered right
            cached.append(result["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0  # the pod computed it all; the next ones hit its real blocks
    finally:
        late.terminate()
