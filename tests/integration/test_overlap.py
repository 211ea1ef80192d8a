"""While a long prompt's KV is received and injected on a decode pod, the
requests already decoding there keep producing tokens.

The decode pod's engine loop never waits for the network or the injector:
layers land on receiver threads and are scattered into reserved slots by the
injector thread. On 2 CPU cores the figures are noisy, so the bound is
generous (no gap over 1 s while the transfer is in flight, and tokens keep
arriving during it); `pdserve bench ttft` measures the timings.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from proto import pdserve_pb2
from tests.integration.flows import prefill_in_background, wait_released

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MAX_GAP_S = 1.0


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1100) for _ in range(n)]


def _start_disaggregated(prefill_stub, decode_stub, request_id, prompt, sampling):
    call = decode_stub.Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
        remote_prefill=True), timeout=120)
    reserved = next(call).reserved
    prefill = prefill_in_background(prefill_stub, pdserve_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
        target=reserved.target), timeout=120)
    return call, prefill


def test_decoding_continues_while_kv_is_injected(prefill_stub, decode_stubs, decode_pods,
                                                 prefill_pod):
    decode = decode_stubs["tcp"]
    running = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=2500, ignore_eos=True)
    call, prefill = _start_disaggregated(prefill_stub, decode, "busy", _prompt(64, 11), running)
    prefill.result()
    arrivals: list[float] = []

    def read() -> None:
        try:
            for message in call:
                arrivals.extend([time.monotonic()] * len(message.tokens.token_ids))
        except grpc.RpcError as exc:  # the test cancels "busy" when it is done
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise

    reader = threading.Thread(target=read)
    reader.start()
    while len(arrivals) < 5:  # "busy" is decoding on the pod
        time.sleep(0.01)

    long_sampling = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    started = time.monotonic()
    long_call, long_prefill = _start_disaggregated(prefill_stub, decode, "long-prompt",
                                                   _prompt(3000, 12), long_sampling)
    assert long_prefill.result().kv_bytes_sent == 2 * 2 * 3000 * 2 * 64 * 4  # layers,K/V,...
    next(long_call)  # its second token: KV injected, committed, decoded
    joined = time.monotonic()
    long_call.cancel()
    call.cancel()
    reader.join()

    during = [t for t in arrivals if started <= t <= joined]
    gaps = [b - a for a, b in zip([started, *during], [*during, joined], strict=True)]
    assert len(during) >= 3, f"only {len(during)} tokens in {joined - started:.2f}s"
    assert max(gaps) < MAX_GAP_S, f"decode stalled {max(gaps):.2f}s during the transfer"
    report = wait_released(decode_pods["tcp"], "Decode")
    assert report.num_free_blocks == report.num_total_blocks
