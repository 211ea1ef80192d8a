"""Simulated pods pass the pod gRPC contract a real pod passes: health,
GetLoad, Generate (colocated and remote prefill: Reserved -> Prefill with
the target -> tokens), Abort, bad input, no room, a refused ticket, and
drain. The flows are the integration tests' own (tests/integration/flows.py),
which drive real pods the way the router does.

One module-scoped cluster (tests/sim/cluster_thread.py): a prefill, a
decode and two colocated pods (the second is drained by the last test).
Tokens come from `sim.engine.token_at`, so the expected ids are exact.
The cluster also serves its pods' metrics on one page (`--metrics-port`).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine.block_manager import cdiv
from proto import pdserve_pb2, pdserve_pb2_grpc
from sim.engine import token_at
from tests.integration.flows import colocated_generate, disaggregated_generate, load, prefill
from tests.sim.cluster_thread import ClusterThread

pytestmark = pytest.mark.timeout(120)

VOCAB = 1100  # the tiny model's
DECODE_BLOCKS = 8  # of 128 tokens


def prompt(seed: int, length: int = 40) -> list[int]:
    return [(seed * 31 + i * 7) % 1000 + 5 for i in range(length)]


def sampling(max_tokens: int, seed: int = 0) -> pdserve_pb2.SamplingParams:
    return pdserve_pb2.SamplingParams(max_tokens=max_tokens, seed=seed, top_p=1.0)


def expected(seed: int, tokens: list[int], n: int) -> list[int]:
    return [token_at(seed, tokens, i, VOCAB) for i in range(n)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[ClusterThread]:
    cluster = ClusterThread(tiny_model_dir, "--prefill", "1", "--decode", "1", "--colocated", "2",
                            "--decode-num-blocks", str(DECODE_BLOCKS),
                            "--prefill-num-blocks", "256", "--grace-period", "30",
                            "--metrics-port", "0")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def stubs(cluster) -> Iterator[dict]:
    addresses = cluster.addresses()
    channels = {role: grpc.insecure_channel(addresses[role][0])
                for role in ("prefill", "decode", "colocated")}
    yield {"prefill": pdserve_pb2_grpc.PrefillStub(channels["prefill"]),
           "decode": pdserve_pb2_grpc.DecodeStub(channels["decode"]),
           "colocated": pdserve_pb2_grpc.DecodeStub(channels["colocated"]),
           "addresses": addresses}
    for channel in channels.values():
        channel.close()


def released(address: str, service: str = "Decode") -> pdserve_pb2.LoadReport:
    """GetLoad once the pod holds no request and no block (or after 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        report = load(address, service)
        if (report.num_free_blocks == report.num_total_blocks and not report.num_running
                and not report.num_waiting) or time.monotonic() > deadline:
            return report
        time.sleep(0.02)


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(
            service="pdserve.v1.Decode"), timeout=5).status


def test_health_and_load_report_name_a_simulated_pod(stubs):
    for role in ("decode", "colocated"):
        assert health(stubs["addresses"][role][0]) == health_pb2.HealthCheckResponse.SERVING
    report = load(stubs["addresses"]["decode"][0])
    assert (report.role, report.model, report.block_size, report.device) == (
        "decode", "tiny", 128, "sim")
    assert report.num_total_blocks == report.num_free_blocks == DECODE_BLOCKS
    assert report.max_model_len == 4096


def test_watch_load_pushes_the_report_at_once_on_change_and_as_heartbeats(stubs):
    """WatchLoad (issue 43), the stream a router keeps to each pod: the first
    report at once, the same report again as a heartbeat while idle, and a
    request's load while it runs."""
    reports: list[pdserve_pb2.LoadReport] = []
    stream = stubs["colocated"].WatchLoad(
        pdserve_pb2.WatchLoadRequest(min_interval_s=0.02, max_interval_s=0.25), timeout=60)

    def read() -> None:
        try:
            reports.extend(stream)
        except grpc.RpcError as error:  # the test's own cancel ends the stream
            if error.code() is not grpc.StatusCode.CANCELLED:
                raise

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 10
        while not reports and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reports and (reports[0].role, reports[0].model) == ("colocated", "tiny")
        time.sleep(1.5)  # idle: heartbeats only, about six
        idle = list(reports)
        assert len(idle) >= 2 and all(r == idle[0] for r in idle)
        colocated_generate(stubs["colocated"], "w-1", prompt(5), sampling(40))
        busy = reports[len(idle):]
        assert any(r.num_running == 1 and r.num_free_blocks < r.num_total_blocks for r in busy)
    finally:
        stream.cancel()
        reader.join(5)


def test_colocated_and_disaggregated_give_the_same_exact_tokens(stubs):
    tokens = prompt(1)
    local = colocated_generate(stubs["colocated"], "c-1", tokens, sampling(6, seed=7))
    remote = disaggregated_generate(stubs["prefill"], stubs["decode"], "d-1", tokens,
                                    sampling(6, seed=7))
    assert local.token_ids == remote.token_ids == expected(7, tokens, 6)
    assert local.finish_reason == remote.finish_reason == "length"
    assert released(stubs["addresses"]["decode"][0]).num_free_blocks == DECODE_BLOCKS


def test_one_metrics_page_labels_every_pods_samples_with_its_pod(cluster, stubs):
    addresses = stubs["addresses"]
    pod = addresses["colocated"][0]
    colocated_generate(stubs["colocated"], "m-1", prompt(3), sampling(2))
    disaggregated_generate(stubs["prefill"], stubs["decode"], "m-2", prompt(4), sampling(2))
    url = f"http://{cluster.cluster.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    blocks = {s.labels["pod"]: (s.labels["role"], s.value)
              for s in families["pdserve_kv_blocks_total"].samples}
    assert blocks == {addresses["prefill"][0]: ("prefill", 256.0),
                      addresses["decode"][0]: ("decode", DECODE_BLOCKS),
                      **{a: ("colocated", 256.0) for a in addresses["colocated"]}}
    # the token signals an autoscaler reads, one sample per pod (idle now: zero)
    waiting = {s.labels["pod"]: s.value for s in families["pdserve_prompt_tokens_waiting"].samples}
    assert waiting == dict.fromkeys(blocks, 0.0)
    finished = {s.labels["pod"]: s.value for s in families["pdserve_e2e_request_latency_seconds"]
                .samples if s.name.endswith("_count")}
    assert finished[pod] >= 1.0
    # every transfer so far landed: the bytes the decode pod received are those sent
    moved = {s.labels["pod"]: s.value for s in families["pdserve_kv_transfer_bytes"].samples
             if s.name.endswith("_total")}
    assert moved[addresses["decode"][0]] == moved[addresses["prefill"][0]] > 0


def test_reserved_holds_context_and_max_tokens_and_prefill_reports_the_bytes(stubs):
    tokens = prompt(2, 200)
    call = stubs["decode"].Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id="d-2", prompt_token_ids=tokens, sampling=sampling(100),
        remote_prefill=True), timeout=60)
    reserved = next(call).reserved
    assert reserved.num_reserved_blocks == cdiv(200 + 100, 128)
    assert load(stubs["addresses"]["decode"][0]).num_free_blocks == DECODE_BLOCKS - 3
    done = prefill(stubs["prefill"], pdserve_pb2.PrefillRequest(
        request_id="d-2", prompt_token_ids=tokens, sampling=sampling(100),
        target=reserved.target))
    assert done.kv_bytes_sent == 200 * 2 * 2 * 2 * 64 * 4  # tokens x K,V x layers x heads x dim
    assert done.first_token.token_id == token_at(0, tokens, 0, VOCAB)
    rest = [t for message in call for t in message.tokens.token_ids]
    assert [done.first_token.token_id, *rest] == expected(0, tokens, 100)
    assert released(stubs["addresses"]["decode"][0]).num_free_blocks == DECODE_BLOCKS


def test_abort_while_waiting_for_kv_frees_the_reservation(stubs):
    call = stubs["decode"].Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id="d-3", prompt_token_ids=prompt(3), sampling=sampling(8),
        remote_prefill=True), timeout=60)
    assert next(call).WhichOneof("kind") == "reserved"
    assert stubs["decode"].Abort(pdserve_pb2.AbortRequest(request_id="d-3"), timeout=5).found
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert released(stubs["addresses"]["decode"][0]).num_free_blocks == DECODE_BLOCKS


def test_a_wrong_ticket_is_refused_by_name_and_nothing_stays_held(stubs):
    call = stubs["decode"].Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id="d-4", prompt_token_ids=prompt(4), sampling=sampling(8),
        remote_prefill=True), timeout=60)
    target = next(call).reserved.target
    target.ticket = b"forged"
    with pytest.raises(grpc.RpcError) as err:
        prefill(stubs["prefill"], pdserve_pb2.PrefillRequest(
            request_id="d-4", prompt_token_ids=prompt(4), sampling=sampling(8), target=target))
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "bad_ticket" in err.value.details()
    call.cancel()
    assert released(stubs["addresses"]["decode"][0]).num_free_blocks == DECODE_BLOCKS
    assert released(stubs["addresses"]["prefill"][0], "Prefill").num_running == 0


def test_no_room_is_resource_exhausted_and_bad_input_invalid_argument(stubs):
    hold = stubs["decode"].Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id="d-5", prompt_token_ids=prompt(5, 500), sampling=sampling(100),
        remote_prefill=True), timeout=60)
    assert next(hold).reserved.num_reserved_blocks == 5
    with pytest.raises(grpc.RpcError) as err:
        next(stubs["decode"].Generate(pdserve_pb2.DecodeGenerateRequest(
            request_id="d-6", prompt_token_ids=prompt(6, 500), sampling=sampling(100),
            remote_prefill=True), timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "5 KV blocks, 3 are free" in err.value.details()
    hold.cancel()
    with pytest.raises(grpc.RpcError) as err:
        colocated_generate(stubs["colocated"], "c-7", [VOCAB + 5], sampling(2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"outside the vocabulary [0, {VOCAB})" in err.value.details()
    assert released(stubs["addresses"]["decode"][0]).num_free_blocks == DECODE_BLOCKS


def test_a_draining_pod_finishes_what_it_has_and_refuses_new_work(cluster, stubs):
    address = stubs["addresses"]["colocated"][1]
    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.DecodeStub(channel)
        call = stub.Generate(pdserve_pb2.DecodeGenerateRequest(
            request_id="c-8", prompt_token_ids=prompt(8), sampling=sampling(60)), timeout=60)
        first = next(call)
        cluster.drain([address])
        deadline = time.monotonic() + 10
        while health(address) == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the draining pod still says SERVING"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            colocated_generate(stub, "c-9", prompt(9), sampling(2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        tokens = [*first.tokens.token_ids, *(t for m in call for t in m.tokens.token_ids)]
        assert tokens == expected(0, prompt(8), 60)
