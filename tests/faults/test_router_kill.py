"""kill -9 of the router with 16 streams open (prefill and decode pods found
through a real Redis registry): within a bounded time every pod holds
nothing -- no running or waiting sequence, every KV block free, no landing
buffer -- through gRPC cancellation of the dead router's calls and the
pods' own deadlines, and a new router on the same registry serves the next
request at once, exactly."""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from tests.faults.stack import assert_pods_at_baseline, idle_report, usage
from tests.integration.pods import start_pods
from tests.redis_server import RedisServer
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_STREAMS = 16
RELEASE_BOUND_S = 20.0  # well inside the pods' reservation and transfer timeouts' sum
POD = {"block_size": 16, "num_blocks": 1024, "advertise_host": "127.0.0.1"}
MAX_TOKENS = 600  # 16 x (600 + prompt) tokens fit the decode pod's 16,384


def _stream(router, prompt: str, tokens: list[str], errors: list[BaseException]) -> None:
    client = openai.OpenAI(base_url=router.base_url, api_key="-", max_retries=0, timeout=120)
    try:
        for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            tokens.append(chunk.choices[0].text if chunk.choices else "")
    except BaseException as exc:  # noqa: BLE001 - the router's death ends every stream
        errors.append(exc)


def test_a_killed_routers_requests_are_freed_and_a_new_router_serves(tiny_model_dir, tmp_path):
    redis = RedisServer(tmp_path)
    pods = {}
    routers = []
    try:
        pods = start_pods({
            "prefill": ("prefill", {**POD, "redis_url": redis.url}),
            "decode": ("decode", {**POD, "redis_url": redis.url, "transfer_timeout": 5,
                                  "reservation_timeout": 10}),
        }, tiny_model_dir)
        flags = dict(redis_url=redis.url, split_prefill_min_tokens=0,
                     local_prefill_max_tokens=0)
        router = start_router(tiny_model_dir, **flags)
        routers.append(router)
        wait_ready(router)
        # warm: the prefill pod's KV connections to the decode pod (kept open
        # for later transfers, with their threads) exist before the baseline
        warm = openai.OpenAI(base_url=router.base_url, api_key="-", max_retries=0, timeout=60)
        before = warm.completions.create(model="tiny", prompt="After the kill", max_tokens=16,
                                         temperature=0).choices[0].text
        baseline = {name: usage(pod.process.pid) for name, pod in pods.items()}
        outputs = [[] for _ in range(NUM_STREAMS)]
        errors: list[BaseException] = []
        threads = [threading.Thread(
            target=_stream, args=(router, f"Stream {i} tells a story " * (1 + i % 5),
                                  outputs[i], errors), daemon=True)
            for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 120
        # most streams decoding, the rest anywhere on the way (queued, prefilling, moving KV)
        while sum(len(o) >= 2 for o in outputs) < NUM_STREAMS // 2:
            assert time.monotonic() < deadline, f"the streams did not start: {errors}"
            time.sleep(0.05)
        _, _, running, _, _ = idle_report(pods["decode"])
        assert running >= NUM_STREAMS // 2
        router.process.send_signal(signal.SIGKILL)
        router.process.wait(10)
        killed_at = time.monotonic()
        assert_pods_at_baseline(pods, baseline, timeout=RELEASE_BOUND_S)
        released_s = time.monotonic() - killed_at
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "a client stream hung after the router died"
        # a new router on the same registry finds the pods and serves at once
        started = time.monotonic()
        again = start_router(tiny_model_dir, **flags)
        routers.append(again)
        wait_ready(again)
        client = openai.OpenAI(base_url=again.base_url, api_key="-", max_retries=0,
                               timeout=60)
        text = client.completions.create(model="tiny", prompt="After the kill", max_tokens=16,
                                         temperature=0).choices[0].text
        assert text == before  # exactly what the first router gave
        assert time.monotonic() - started < 30
        print(f"pods released everything {released_s:.2f}s after the kill")
    finally:
        for router in routers:
            router.process.kill()
        for pod in pods.values():
            pod.kill()
        redis.stop()
