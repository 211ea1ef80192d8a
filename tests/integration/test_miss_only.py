"""Cache-miss-only transfer and conditional disaggregation, on real pods.

Two more decode pods with their prefix cache on (block 16 over TCP, block
32 over gRPC) beside the package's colocated pod, prefill pod (block 16)
and cache-less decode pods (full transfer). A first request fills a decode
pod's prefix cache; a second one that shares a prefix ending inside a
block, or at a block's edge, gets only its uncached tokens sent and still
produces the colocated pod's tokens, as a full transfer does.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest

from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.integration.conftest import RESERVATION_TIMEOUT_S, TRANSFER_TIMEOUT_S
from tests.integration.flows import (
    Generated,
    colocated_generate,
    disaggregated_generate,
    prefill,
    wait_released,
)
from tests.integration.pods import PodProcess, start_pods

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_FLAGS = {"transfer_timeout": TRANSFER_TIMEOUT_S, "reservation_timeout": RESERVATION_TIMEOUT_S,
          "landing_memory": "64MiB", "prefix_cache": True}
SPECS = {
    "tcp": ("decode", {"block_size": 16, "num_blocks": 128, "kv_transport": "tcp", **_FLAGS}),
    "grpc": ("decode", {"block_size": 32, "num_blocks": 64, "kv_transport": "grpc",
                        "async_scheduling": True, **_FLAGS}),
}
SAMPLING = pdserve_pb2.SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=99,
                                      max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cached_pods(tiny_model_dir) -> Iterator[dict[str, PodProcess]]:
    started = start_pods(SPECS, tiny_model_dir)
    yield started
    for pod in started.values():
        pod.sigterm()
    for pod in started.values():
        try:
            assert pod.terminate(timeout=30) == 0, f"{pod.role} pod exit status"
        finally:
            pod.kill()


@pytest.fixture(scope="module")
def cached_stubs(cached_pods) -> Iterator[dict[str, pdserve_pb2_grpc.DecodeStub]]:
    channels = {name: grpc.insecure_channel(pod.address) for name, pod in cached_pods.items()}
    yield {name: pdserve_pb2_grpc.DecodeStub(ch) for name, ch in channels.items()}
    for channel in channels.values():
        channel.close()


def _miss_only_generate(prefill_stub, decode, request_id: str, prompt: list[int]
                        ) -> tuple[Generated, int, int]:
    """The router's P/D flow; returns (result, tokens the decode pod held, bytes sent)."""
    call = decode.Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=SAMPLING,
        remote_prefill=True), timeout=120)
    try:
        first = next(call)
        assert first.WhichOneof("kind") == "reserved"
        target = first.reserved.target
        response = prefill(prefill_stub, pdserve_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=SAMPLING, target=target))
        tokens = [response.first_token.token_id]
        for message in call:
            assert message.tokens.first_index == len(tokens)
            tokens.extend(message.tokens.token_ids)
        return Generated(tokens, "length", 0), target.num_held_tokens, response.kv_bytes_sent
    finally:
        call.cancel()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_miss_only_transfer_matches_colocated_and_full_transfer(
        transport, cached_pods, cached_stubs, prefill_stub, colocated_stub, decode_stubs):
    rng = random.Random({"tcp": 12, "grpc": 13}[transport])
    common = [rng.randrange(5, 1100) for _ in range(64)]
    first_prompt = common + [rng.randrange(5, 1100) for _ in range(16)]  # 80 tokens
    pod, stub = cached_pods[transport], cached_stubs[transport]
    result, held, first_bytes = _miss_only_generate(prefill_stub, stub, f"fill-{transport}",
                                                    first_prompt)
    assert held == 0
    token_bytes = first_bytes // len(first_prompt)
    assert token_bytes * len(first_prompt) == first_bytes
    saved_before = pod.metric_value("pdserve_kv_transfer_saved_bytes_total")
    # (shared tokens, held tokens): the prefix ends inside a block (both pods
    # hold the 32 tokens before it) or at a block's edge (64 held)
    for shared, want_held in ((40, 32), (64, 64)):
        prompt = common[:shared] + [rng.randrange(5, 1100) for _ in range(23)]
        rid = f"{transport}-{shared}"
        result, held, sent = _miss_only_generate(prefill_stub, stub, f"miss-{rid}", prompt)
        assert held == want_held
        assert sent == token_bytes * (len(prompt) - held)  # shrinks by the held prefix
        colocated = colocated_generate(colocated_stub, f"col-{rid}", prompt, SAMPLING)
        full = disaggregated_generate(prefill_stub, decode_stubs[transport], f"full-{rid}",
                                      prompt, SAMPLING)
        assert len(result.token_ids) == 8
        assert result.token_ids == colocated.token_ids == full.token_ids, shared
    saved = pod.metric_value("pdserve_kv_transfer_saved_bytes_total") - saved_before
    assert saved == token_bytes * (32 + 64)
    report = wait_released(pod, "Decode")
    assert report.num_free_blocks == report.num_total_blocks


def test_few_new_tokens_after_the_cached_prefix_are_computed_on_the_decode_pod(
        cached_pods, cached_stubs, prefill_stub, colocated_stub):
    rng = random.Random(14)
    common = [rng.randrange(5, 1100) for _ in range(48)]
    pod, stub = cached_pods["tcp"], cached_stubs["tcp"]
    _miss_only_generate(prefill_stub, stub, "local-fill", common + [7, 8, 9])
    prompt = common + [rng.randrange(5, 1100) for _ in range(10)]  # 48 held, 10 new
    bytes_before = pod.metric_value("pdserve_kv_transfer_bytes_total")
    tokens: list[int] = []
    for message in stub.Generate(pdserve_pb2.DecodeGenerateRequest(
            request_id="local-short", prompt_token_ids=prompt, sampling=SAMPLING,
            remote_prefill=True, local_prefill_below=11), timeout=120):
        assert message.WhichOneof("kind") == "tokens"  # no Reserved: no transfer
        assert message.tokens.first_index == len(tokens)
        tokens.extend(message.tokens.token_ids)
        if message.tokens.num_prompt_tokens:
            assert message.tokens.num_cached_tokens == 48
    assert tokens == colocated_generate(colocated_stub, "local-col", prompt, SAMPLING).token_ids
    assert pod.metric_value("pdserve_kv_transfer_bytes_total") == bytes_before
    # 10 new tokens are not fewer than 10: reserved for a transfer as usual
    call = stub.Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id="local-long", prompt_token_ids=prompt, sampling=SAMPLING,
        remote_prefill=True, local_prefill_below=10), timeout=120)
    first = next(call)
    assert first.WhichOneof("kind") == "reserved"
    assert first.reserved.target.num_held_tokens == 48
    call.cancel()
    report = wait_released(pod, "Decode")
    assert report.num_free_blocks == report.num_total_blocks
