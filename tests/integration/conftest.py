"""Pods shared by the integration tests (real processes on loopback, tiny model).

Session-scoped and started together, so the whole package pays for one pod
start-up: a colocated pod (the parity baseline), a prefill pod (block 16,
prefix cache on, 256-token chunks so long prompts stream over several
steps), and two decode pods: block 128 over TCP and block 256 over gRPC,
both with short transfer and reservation timeouts so the never-arriving-KV
test is quick.
The prefill pod and the gRPC decode pod run with async scheduling (off by
default on CPU), so parity against the colocated pod also checks it end to
end; the TCP decode pod keeps the synchronous default.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from proto import pdserve_pb2_grpc
from tests.integration.pods import PodProcess, start_pods

TRANSFER_TIMEOUT_S = 4.0
RESERVATION_TIMEOUT_S = 4.0

_DECODE_FLAGS = {"transfer_timeout": TRANSFER_TIMEOUT_S,
                 "reservation_timeout": RESERVATION_TIMEOUT_S, "landing_memory": "64MiB"}
POD_SPECS = {
    "colocated": ("colocated", {"block_size": 16, "num_blocks": 512}),
    "prefill": ("prefill", {"block_size": 16, "num_blocks": 512,
                            "max_num_batched_tokens": 256, "kv_streams": 4,
                            "async_scheduling": True}),
    "tcp": ("decode", {"block_size": 128, "num_blocks": 64, "kv_transport": "tcp",
                       **_DECODE_FLAGS}),
    "grpc": ("decode", {"block_size": 256, "num_blocks": 32, "kv_transport": "grpc",
                        "async_scheduling": True, **_DECODE_FLAGS}),
}


@pytest.fixture(scope="session")
def pods(tiny_model_dir) -> Iterator[dict[str, PodProcess]]:
    started = start_pods(POD_SPECS, tiny_model_dir)
    yield started
    for pod in started.values():  # drain all at once, then wait for each
        pod.sigterm()
    for pod in started.values():
        try:
            assert pod.terminate(timeout=30) == 0, f"{pod.role} pod exit status"
        finally:
            pod.kill()


@pytest.fixture(scope="session")
def colocated_pod(pods) -> PodProcess:
    return pods["colocated"]


@pytest.fixture(scope="session")
def prefill_pod(pods) -> PodProcess:
    return pods["prefill"]


@pytest.fixture(scope="session")
def decode_pods(pods) -> dict[str, PodProcess]:
    """{"tcp": block-128 pod over TCP, "grpc": block-256 pod over gRPC}."""
    return {"tcp": pods["tcp"], "grpc": pods["grpc"]}


@pytest.fixture(scope="session")
def colocated_stub(colocated_pod) -> Iterator[pdserve_pb2_grpc.DecodeStub]:
    with grpc.insecure_channel(colocated_pod.address) as channel:
        yield pdserve_pb2_grpc.DecodeStub(channel)


@pytest.fixture(scope="session")
def prefill_stub(prefill_pod) -> Iterator[pdserve_pb2_grpc.PrefillStub]:
    with grpc.insecure_channel(prefill_pod.address) as channel:
        yield pdserve_pb2_grpc.PrefillStub(channel)


@pytest.fixture(scope="session")
def decode_stubs(decode_pods) -> Iterator[dict[str, pdserve_pb2_grpc.DecodeStub]]:
    channels = {name: grpc.insecure_channel(pod.address) for name, pod in decode_pods.items()}
    yield {name: pdserve_pb2_grpc.DecodeStub(ch) for name, ch in channels.items()}
    for channel in channels.values():
        channel.close()
