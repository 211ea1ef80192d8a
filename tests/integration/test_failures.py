"""Bad input, KV that never arrives, and cancellation at every stage: each
ends with a clear status and both pods end with every block and landing
buffer free (GetLoad num_free_blocks == total, landing bytes == 0)."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from proto import pdserve_pb2
from tests.integration.conftest import RESERVATION_TIMEOUT_S
from tests.integration.flows import (
    colocated_generate,
    disaggregated_generate,
    load,
    prefill,
    prefill_in_background,
    wait_released,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

GREEDY = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1100) for _ in range(n)]


def _assert_released(prefill_pod, decode_pod) -> None:
    for pod, service in ((prefill_pod, "Prefill"), (decode_pod, "Decode")):
        report = wait_released(pod, service)
        assert (report.num_free_blocks, report.num_running, report.num_waiting) == (
            report.num_total_blocks, 0, 0), pod.role
    assert decode_pod.metric_value("pdserve_kv_landing_bytes_in_use") == 0.0


def _client_aborts(pod) -> float:
    try:
        return pod.metric_value("pdserve_aborts_total", reason="client")
    except KeyError:  # no client abort counted yet
        return 0.0


def _open_reserved(decode_stub, request_id: str, prompt: list[int], sampling=GREEDY):
    call = decode_stub.Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
        remote_prefill=True), timeout=60)
    first = next(call)
    assert first.WhichOneof("kind") == "reserved"
    return call, first.reserved


def _wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("sampling", "prompt_len", "message"), [
    (pdserve_pb2.SamplingParams(max_tokens=8), 4095,
     "prompt (4095 tokens) + max_tokens (8) = 4103 exceeds max_model_len 4096"),
    (pdserve_pb2.SamplingParams(max_tokens=-1), 10,
     "max_tokens must be >= 0 (0 = score the prompt only), got -1"),
    (pdserve_pb2.SamplingParams(max_tokens=4, top_p=1.5), 10, "top_p must be in (0, 1], got 1.5"),
    (pdserve_pb2.SamplingParams(max_tokens=4, temperature=-1), 10,
     "temperature must be a finite number >= 0, got -1.0"),
])
def test_bad_input_is_invalid_argument_and_pods_keep_serving(
        sampling, prompt_len, message, colocated_stub, prefill_stub, decode_stubs):
    prompt = [7] * prompt_len
    calls = [
        lambda: list(colocated_stub.Generate(pdserve_pb2.DecodeGenerateRequest(
            request_id="bad", prompt_token_ids=prompt, sampling=sampling), timeout=30)),
        lambda: list(decode_stubs["tcp"].Generate(pdserve_pb2.DecodeGenerateRequest(
            request_id="bad", prompt_token_ids=prompt, sampling=sampling,
            remote_prefill=True), timeout=30)),
        lambda: list(prefill_stub.Prefill(pdserve_pb2.PrefillRequest(
            request_id="bad", prompt_token_ids=prompt, sampling=sampling), timeout=30)),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == message
    result = colocated_generate(colocated_stub, "after-bad", [7] * 10, GREEDY)
    assert len(result.token_ids) == 8


def test_token_outside_vocabulary_is_refused(colocated_stub):
    with pytest.raises(grpc.RpcError) as err:
        list(colocated_stub.Generate(pdserve_pb2.DecodeGenerateRequest(
            request_id="vocab", prompt_token_ids=[3, 5000], sampling=GREEDY), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "prompt_token_ids contains 5000, outside the vocabulary [0, 1100)"


# ---------------------------------------------------------------- KV never arrives


def test_kv_that_never_arrives_fails_at_the_deadline(decode_stubs, decode_pods, prefill_pod):
    call, reserved = _open_reserved(decode_stubs["tcp"], "no-kv", _prompt(40, 1))
    assert reserved.num_reserved_blocks == 1  # 40 + 8 tokens in one block of 128
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    waited = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # no prefill pod ever began sending: the reservation's deadline, not the transfer's
    assert err.value.details().startswith(
        "KV for request no-kv did not arrive in time (deadline: no sender began before the "
        "reservation's deadline ")
    assert RESERVATION_TIMEOUT_S - 0.5 < waited < RESERVATION_TIMEOUT_S + 3.0
    _assert_released(prefill_pod, decode_pods["tcp"])
    failures = decode_pods["tcp"].metric_value("pdserve_kv_transfer_failures_total",
                                               reason="deadline")
    assert failures >= 1


# ---------------------------------------------------------------- cancel at every stage


def test_cancel_while_queued_on_the_prefill_pod(prefill_stub, decode_stubs, prefill_pod,
                                                decode_pods):
    # A 4000-token prompt keeps the prefill pod's 256-token budget busy for
    # 16 steps; the request behind it waits in the queue.
    filler = prefill_in_background(prefill_stub, pdserve_pb2.PrefillRequest(
        request_id="filler", prompt_token_ids=_prompt(4000, 2), sampling=GREEDY), timeout=60)
    _wait_until(lambda: load(prefill_pod.address, "Prefill").num_running == 1)
    call, reserved = _open_reserved(decode_stubs["tcp"], "queued", _prompt(300, 3))
    queued = prefill_stub.Prefill(pdserve_pb2.PrefillRequest(
        request_id="queued", prompt_token_ids=_prompt(300, 3), sampling=GREEDY,
        target=reserved.target), timeout=60)
    _wait_until(lambda: load(prefill_pod.address, "Prefill").num_waiting == 1)
    aborted = _client_aborts(prefill_pod)
    queued.cancel()
    call.cancel()
    assert filler.result().first_token.num_prompt_tokens == 4000
    _wait_until(lambda: _client_aborts(prefill_pod) == aborted + 1)
    _assert_released(prefill_pod, decode_pods["tcp"])


def test_cancel_mid_transfer(prefill_stub, decode_stubs, prefill_pod, decode_pods):
    prompt = _prompt(4000, 4)
    call, reserved = _open_reserved(decode_stubs["grpc"], "mid", prompt)
    pending = prefill_stub.Prefill(pdserve_pb2.PrefillRequest(
        request_id="mid", prompt_token_ids=prompt, sampling=GREEDY, target=reserved.target),
        timeout=60)
    # Some of the 16 chunks are computed and streaming when both calls are cancelled.
    _wait_until(lambda: load(prefill_pod.address, "Prefill").num_running == 1)
    time.sleep(0.05)
    aborted = _client_aborts(prefill_pod)
    pending.cancel()
    call.cancel()
    # the prefill pod's engine aborted the request: it had not finished
    _wait_until(lambda: _client_aborts(prefill_pod) == aborted + 1)
    _assert_released(prefill_pod, decode_pods["grpc"])


def test_cancel_while_waiting_for_kv(decode_stubs, prefill_pod, decode_pods):
    call, _ = _open_reserved(decode_stubs["tcp"], "waiting", _prompt(200, 5))
    assert load(decode_pods["tcp"].address).num_free_blocks < 64
    call.cancel()
    _assert_released(prefill_pod, decode_pods["tcp"])


def test_abort_rpc_while_waiting_for_kv(decode_stubs, prefill_pod, decode_pods):
    call, _ = _open_reserved(decode_stubs["tcp"], "abort-me", _prompt(200, 6))
    found = decode_stubs["tcp"].Abort(pdserve_pb2.AbortRequest(request_id="abort-me",
                                                               reason="router gave up"))
    assert found.found is True
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert err.value.details() == ("request abort-me was aborted while waiting for its KV "
                                   "(router gave up)")
    _assert_released(prefill_pod, decode_pods["tcp"])


def test_cancel_while_decoding(prefill_stub, decode_stubs, prefill_pod, decode_pods):
    prompt = _prompt(100, 7)
    sampling = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    call, reserved = _open_reserved(decode_stubs["tcp"], "decoding", prompt, sampling)
    prefill(prefill_stub, pdserve_pb2.PrefillRequest(
        request_id="decoding", prompt_token_ids=prompt, sampling=sampling,
        target=reserved.target), timeout=60)
    received = 0
    for message in call:
        received += len(message.tokens.token_ids)
        if received >= 3:
            break
    call.cancel()
    _assert_released(prefill_pod, decode_pods["tcp"])


def test_abort_rpc_while_decoding_ends_the_stream(prefill_stub, decode_stubs, prefill_pod,
                                                  decode_pods):
    prompt = _prompt(50, 8)
    sampling = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    call, reserved = _open_reserved(decode_stubs["grpc"], "abort-dec", prompt, sampling)
    prefill(prefill_stub, pdserve_pb2.PrefillRequest(
        request_id="abort-dec", prompt_token_ids=prompt, sampling=sampling,
        target=reserved.target), timeout=60)
    next(call)
    threading.Thread(target=decode_stubs["grpc"].Abort, args=(pdserve_pb2.AbortRequest(
        request_id="abort-dec"),)).start()
    last = None
    for message in call:
        last = message
    assert last is not None and last.tokens.finish_reason == "abort"
    _assert_released(prefill_pod, decode_pods["grpc"])


def test_pods_still_produce_parity_after_failures(colocated_stub, prefill_stub, decode_stubs):
    prompt = _prompt(90, 9)
    want = colocated_generate(colocated_stub, "after-col", prompt, GREEDY)
    got = disaggregated_generate(prefill_stub, decode_stubs["tcp"], "after-dis", prompt, GREEDY)
    assert got.token_ids == want.token_ids


# ---------------------------------------------------------------- capacity and dead targets


def test_full_decode_pod_answers_resource_exhausted(decode_stubs, decode_pods, prefill_pod):
    sampling = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    # 4000 + 96 tokens = 32 blocks of 128: two such reservations fill the 64-block pod
    held = [_open_reserved(decode_stubs["tcp"], f"hold-{i}", _prompt(4000, 20 + i), sampling)
            for i in range(2)]
    with pytest.raises(grpc.RpcError) as err:
        list(decode_stubs["tcp"].Generate(pdserve_pb2.DecodeGenerateRequest(
            request_id="one-too-many", prompt_token_ids=_prompt(10, 22), sampling=GREEDY,
            remote_prefill=True), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "request needs 1 KV blocks, 0 are free"
    for call, _ in held:
        call.cancel()
    _assert_released(prefill_pod, decode_pods["tcp"])


def test_prefill_to_an_unreachable_decode_pod_fails_with_the_reason(prefill_stub, prefill_pod,
                                                                    decode_pods):
    target = pdserve_pb2.KVTarget(endpoints=["127.0.0.1:1"], ticket=b"x" * 16, transport="tcp",
                                  generation=1, deadline_unix_ms=int((time.time() + 5) * 1000))
    with pytest.raises(grpc.RpcError) as err:
        prefill(prefill_stub, pdserve_pb2.PrefillRequest(
            request_id="dead-target", prompt_token_ids=_prompt(40, 23), sampling=GREEDY,
            target=target), timeout=30)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert err.value.details().startswith(
        "KV transfer of dead-target to 127.0.0.1:1 failed: connect")
    _assert_released(prefill_pod, decode_pods["tcp"])
