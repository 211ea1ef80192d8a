"""Client flows the integration tests drive, written the way the router runs them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.integration.pods import PodProcess


@dataclass(frozen=True)
class Prefilled:
    first_token: pdserve_pb2.PrefillFirstToken
    kv_bytes_sent: int  # from the final message: the decode pod accepted the KV


def prefill(stub: pdserve_pb2_grpc.PrefillStub, request: pdserve_pb2.PrefillRequest,
            timeout: float = 120) -> Prefilled:
    """Prefill.Prefill read to its end: the first token, then the transfer's
    outcome; a failed transfer raises its grpc.RpcError."""
    first, done = stub.Prefill(request, timeout=timeout)
    assert first.WhichOneof("kind") == "first_token"
    assert done.WhichOneof("kind") == "transfer_done"
    return Prefilled(first.first_token, done.transfer_done.kv_bytes_sent)


def prefill_in_background(stub: pdserve_pb2_grpc.PrefillStub,
                          request: pdserve_pb2.PrefillRequest,
                          timeout: float = 120) -> Future[Prefilled]:
    """`prefill` on its own thread (the call blocks until the transfer's verdict)."""
    future: Future[Prefilled] = Future()

    def run() -> None:
        try:
            future.set_result(prefill(stub, request, timeout))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


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


def disaggregated_generate(prefill_stub: pdserve_pb2_grpc.PrefillStub,
                           decode: pdserve_pb2_grpc.DecodeStub, request_id: str,
                           prompt: list[int], sampling: pdserve_pb2.SamplingParams,
                           output_token_ids: tuple[int, ...] = (),
                           before_prefill: Callable[[], None] | None = None) -> Generated:
    """The router's flow: Decode.Generate(remote_prefill) -> Reserved ->
    Prefill.Prefill(target) -> first token -> tokens 1..n from the decode stream.
    With `output_token_ids` (a migrated request) generation resumes at index
    len(output_token_ids); the result holds only the new tokens.
    `before_prefill` runs once the reservation is made (to disturb it)."""
    call = decode.Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
        output_token_ids=output_token_ids, remote_prefill=True), timeout=120)
    try:
        first = next(call)
        assert first.WhichOneof("kind") == "reserved"
        if before_prefill is not None:
            before_prefill()
        response = prefill(prefill_stub, pdserve_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
            output_token_ids=output_token_ids, target=first.reserved.target))
        assert response.kv_bytes_sent > 0
        tokens = [response.first_token.token_id]
        reason = ""
        for message in call:
            assert message.tokens.first_index == len(output_token_ids) + len(tokens), (
                "gap or duplicate in the stream")
            tokens.extend(message.tokens.token_ids)
            reason = message.tokens.finish_reason
        return Generated(tokens, reason, response.first_token.num_cached_tokens)
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
