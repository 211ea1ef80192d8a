"""Redis restored empty (FLUSHALL), and Redis lost (killed) then back empty
on the same port, under load: real pods, a real `pdserve router`, a real
redis-server.

A pod that vanishes from Redis but still answers its health polls stays
routable for the registry grace period (router/registry/poller.py), and its
heartbeat writes the key back within one beat (pod/heartbeat.py): no request
may see a 503 in between.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.pods import start_pods
from tests.redis_server import RedisServer
from tests.router.routers import RouterProcess, start_router

pytestmark = pytest.mark.slow


def _post(router: RouterProcess, prompt: str) -> int:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{router.base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _flush(redis_server: RedisServer) -> None:
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()


def _lose_and_restore_empty(redis_server: RedisServer) -> None:
    redis_server.stop()  # SIGKILL: every connection to it breaks
    time.sleep(1.0)  # lost for a while, under load (the disruption itself, not a wait)
    redis_server.restart()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("disrupt", [_flush, _lose_and_restore_empty], ids=["flushall", "lost"])
def test_redis_emptied_under_load_drops_no_pod_and_pods_re_register(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, disrupt
) -> None:
    redis_server = RedisServer(tmp_path_factory.mktemp("redis-flush"))
    pods = []
    router = None
    try:
        flags = {"num_blocks": 512, "redis_url": redis_server.url}
        pods = list(start_pods({"p": ("prefill", flags), "d": ("decode", flags)},
                               tiny_model_dir).values())
        router = start_router(tiny_model_dir, redis_url=redis_server.url, poll_interval=0.1)
        assert router.healthy_pods() == {"prefill": 1, "decode": 1, "colocated": 0}
        statuses: list[int] = []
        stop = threading.Event()

        def load() -> None:
            i = 0
            while not stop.is_set():
                statuses.append(_post(router, f"under flush {i}"))
                i += 1

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        keys = [f"pdserve:pods:{p.role}:{p.address}" for p in pods]
        client = None
        try:
            while len(statuses) < 3:
                assert worker.is_alive() and len(statuses) < 1000
                time.sleep(0.05)
            disrupt(redis_server)
            flushed_at = time.monotonic()
            client = redis_server.client()
            # the heartbeats (ttl 6 s, a beat every 2 s) write the keys back
            while client.exists(*keys) < len(keys):
                assert time.monotonic() - flushed_at < 5, "pods did not re-register within 5 s"
                time.sleep(0.05)
            # keep the load going past several router polls after the flush
            while time.monotonic() - flushed_at < 3:
                time.sleep(0.05)
            served_after = len(statuses)
        finally:
            stop.set()
            worker.join(timeout=35)
            if client is not None:
                client.close()
        assert served_after > 10
        assert [s for s in statuses if s != 200] == [], router.log_tail()
        assert router.healthy_pods() == {"prefill": 1, "decode": 1, "colocated": 0}
    finally:
        if router is not None:
            router.terminate()
        for pod in pods:
            pod.kill()
        redis_server.stop()
