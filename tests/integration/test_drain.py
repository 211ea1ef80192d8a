"""SIGTERM: the pod stops taking work (health NOT_SERVING, new requests
UNAVAILABLE), finishes what is in flight, and exits 0. The same pod runs
with --redis-url against a real redis-server: it registers itself while
serving and deletes its key when it drains."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.integration.pods import start_pod
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_sigterm_drains_in_flight_requests_then_exits_zero(tiny_model_dir, tmp_path):
    redis = RedisServer(tmp_path)
    pod = None
    try:
        pod = start_pod("colocated", tiny_model_dir, block_size=16, num_blocks=128,
                        grace_period=60, redis_url=redis.url, advertise_host="127.0.0.1")
        key = f"pdserve:pods:colocated:127.0.0.1:{pod.grpc_port}"
        record = json.loads(redis.client().get(key))
        assert (record["role"], record["address"], record["model"]) == (
            "colocated", f"127.0.0.1:{pod.grpc_port}", tiny_model_dir.name)
        channel = grpc.insecure_channel(pod.address)
        stub = pdserve_pb2_grpc.DecodeStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        sampling = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        call = stub.Generate(pdserve_pb2.DecodeGenerateRequest(
            request_id="in-flight", prompt_token_ids=[9] * 30, sampling=sampling), timeout=120)
        tokens: list[int] = []
        reasons: list[str] = []
        first = threading.Event()

        def read() -> None:
            for message in call:
                tokens.extend(message.tokens.token_ids)
                reasons.append(message.tokens.finish_reason)
                first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(60)
        pod.sigterm()

        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.02)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pdserve_pb2.DecodeGenerateRequest(
                request_id="late", prompt_token_ids=[9] * 30, sampling=sampling), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert reader.is_alive(), "the in-flight request ended before the test could check"

        reader.join(60)
        assert len(tokens) == 200 and reasons[-1] == "length"
        assert pod.process.wait(30) == 0
        assert redis.client().get(key) is None  # deregistered on drain
        channel.close()
    finally:
        if pod is not None:
            pod.kill()
        redis.stop()
