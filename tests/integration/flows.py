"""Client flows the integration tests drive, written the way the router runs them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.integration.pods import PodProcess


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int  # on the pod that computed the prompt


def colocated_generate(stub: pdserve_pb2_grpc.DecodeStub, request_id: str, prompt: list[int],
                       sampling: pdserve_pb2.SamplingParams) -> Generated:
    """Decode.Generate(remote_prefill=false): indices 0..n, contiguous."""
    tokens: list[int] = []
    reason, cached = "", 0
    for message in stub.Generate(pdserve_pb2.DecodeGenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling), timeout=120):
        assert message.WhichOneof("kind") == "tokens"
        assert message.tokens.first_index == len(tokens), "gap or duplicate in the stream"
        tokens.extend(message.tokens.token_ids)
        reason, cached = message.tokens.finish_reason, message.tokens.num_cached_tokens
    return Generated(tokens, reason, cached)


def disaggregated_generate(prefill: pdserve_pb2_grpc.PrefillStub,
                           decode: pdserve_pb2_grpc.DecodeStub, request_id: str,
                           prompt: list[int], sampling: pdserve_pb2.SamplingParams,
                           output_token_ids: tuple[int, ...] = ()) -> Generated:
    """The router's flow: Decode.Generate(remote_prefill) -> Reserved ->
    Prefill.Prefill(target) -> first token -> tokens 1..n from the decode stream.
    With `output_token_ids` (a migrated request) generation resumes at index
    len(output_token_ids); the result holds only the new tokens."""
    call = decode.Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
        output_token_ids=output_token_ids, remote_prefill=True), timeout=120)
    try:
        first = next(call)
        assert first.WhichOneof("kind") == "reserved"
        response = prefill.Prefill(pdserve_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
            output_token_ids=output_token_ids, target=first.reserved.target), timeout=120)
        assert response.kv_bytes_sent > 0
        tokens = [response.first_token_id]
        reason = ""
        for message in call:
            assert message.tokens.first_index == len(output_token_ids) + len(tokens), (
                "gap or duplicate in the stream")
            tokens.extend(message.tokens.token_ids)
            reason = message.tokens.finish_reason
        return Generated(tokens, reason, response.num_cached_tokens)
    finally:
        call.cancel()


def load(address: str, service: str = "Decode") -> pdserve_pb2.LoadReport:
    with grpc.insecure_channel(address) as channel:
        stub = getattr(pdserve_pb2_grpc, f"{service}Stub")(channel)
        return stub.GetLoad(pdserve_pb2.LoadRequest(), timeout=10)


def wait_released(pod: PodProcess, service: str, timeout: float = 15.0) -> pdserve_pb2.LoadReport:
    """Poll until `pod` holds no request, no block and (decode) no landing
    buffer; returns the last report (the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    while True:
        report = load(pod.address, service)
        landing = (pod.metric_value("pdserve_kv_landing_bytes_in_use")
                   if pod.role == "decode" else 0.0)
        idle = (report.num_free_blocks == report.num_total_blocks and report.num_running == 0
                and report.num_waiting == 0 and landing == 0.0)
        if idle or time.monotonic() > deadline:
            return report
        time.sleep(0.05)
