"""Pods die under a running router (real processes, tiny model, kill -9):
requests move or retry and finish exactly as the colocated baseline would,
or fail with a clear error — none hangs.

The router polls loads only every 30 s here, so after a kill it still sends
work to the dead pod: that exercises the prefill retry and the decode-side
refusal and migration paths, not just the poller dropping the pod.
Cluster (module scope): 3 prefill, 3 decode, 1 colocated pod (the baseline);
each test kills its own pods.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.pods import start_pod
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _generate(router, prompt: str, max_tokens: int, on_tokens=None, timeout: float = 120):
    """Stream Router.Generate (greedy, no EOS stop); returns all token ids."""
    tokens: list[int] = []
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
        for message in stub.Generate(request, timeout=timeout):
            tokens.extend(message.token_ids)
            if on_tokens is not None:
                on_tokens(len(tokens))
            if message.finish_reason:
                assert message.finish_reason == "length"
    return tokens


def _running(pod) -> int:
    if not pod.alive():
        return 0
    with grpc.insecure_channel(pod.address) as channel:
        stub = pdserve_pb2_grpc.DecodeStub(channel)
        return stub.GetLoad(pb.LoadRequest(), timeout=10).num_running


def _bytes_sent(pod) -> float:
    if not pod.alive():  # killed by an earlier test
        return 0.0
    try:
        return pod.metric_value("pdserve_kv_transfer_bytes_total")
    except KeyError:  # nothing sent yet
        return 0.0


def _prefill_pod_for(cluster, prompt: str):
    """The prefill pod the router sends `prompt` to (prefix affinity is sticky):
    the one whose sent KV bytes grow while a one-token request runs."""
    before = [_bytes_sent(p) for p in cluster["prefill"]]
    _generate(cluster["pd"], prompt, 1)
    grew = [p for p, b in zip(cluster["prefill"], before, strict=True) if _bytes_sent(p) > b]
    assert len(grew) == 1
    return grew[0]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    roles = ["prefill"] * 3 + ["decode"] * 3 + ["colocated"]
    # small prefill steps: a long prompt's KV goes out over many chunks, so a kill
    # can land between its BEGIN and its END
    flags = {"prefill": {"max_num_batched_tokens": 32}}
    with ThreadPoolExecutor(len(roles)) as pool:
        pods = [f.result() for f in [pool.submit(start_pod, r, tiny_model_dir, **flags.get(r, {}))
                                     for r in roles]]  # fmt: skip
    prefill, decode = pods[:3], pods[3:6]
    routers = []
    try:
        # the whole-prompt path, whose lost sender restarts against the same
        # reservation (a split cannot: tests/router/test_split_prefill_e2e.py
        # kills a prefill pod mid-head)
        routers.append(start_router(tiny_model_dir, prefill=[p.address for p in prefill],
                                    decode=[d.address for d in decode],
                                    load_poll_interval=30, max_migrations=4,
                                    split_prefill_min_tokens=0))
        routers.append(start_router(tiny_model_dir, colocated=[pods[6].address]))
        for router in routers:
            wait_ready(router)
        yield {"prefill": prefill, "decode": decode, "pd": routers[0], "co": routers[1]}
    finally:
        for router in routers:
            router.terminate()
        for pod in pods:
            pod.kill()


def test_decode_pod_killed_mid_stream_keeps_the_stream_exact(cluster):
    prompt = "A long story about routers and pods"
    expected = _generate(cluster["co"], prompt, 120)
    killed = []

    def kill_serving_decode_pod(num_tokens: int) -> None:
        if num_tokens >= 10 and not killed:
            victim = next(d for d in cluster["decode"] if _running(d) == 1)
            victim.kill()
            killed.append(victim)

    got = _generate(cluster["pd"], prompt, 120, on_tokens=kill_serving_decode_pod)
    assert len(killed) == 1
    assert got == expected  # no duplicates, no gaps, the same greedy tokens
    assert cluster["pd"].metric("pdserve_migrations_total") == 1


def _metric_or_zero(pod, name: str, **labels: str) -> float:
    if not pod.alive():
        return 0.0
    try:
        return pod.metric_value(name, **labels)
    except KeyError:  # not observed yet
        return 0.0


def _decode_snapshot(cluster) -> list[tuple[float, float, float]]:
    """Per decode pod: (KV transfers that completed, requests it aborted, senders lost)."""
    return [(_metric_or_zero(d, "pdserve_kv_transfer_seconds_count"),
             _metric_or_zero(d, "pdserve_aborts_total"),
             _metric_or_zero(d, "pdserve_kv_senders_lost_total")) for d in cluster["decode"]]


def _received(cluster) -> float:
    return sum(_metric_or_zero(d, "pdserve_kv_received_bytes_total") for d in cluster["decode"])


def test_prefill_pod_killed_mid_transfer_retries_against_the_same_reservation(cluster):
    pd = cluster["pd"]
    prefix = " ".join(f"shared{i}" for i in range(100))  # decides the prefill pod
    victim = _prefill_pod_for(cluster, prefix + " ".join(f"a{i}" for i in range(500)))
    prompt = prefix + " ".join(f"b{i}" for i in range(500))
    expected = _generate(cluster["co"], prompt, 8)
    retries, migrations = pd.metric("pdserve_retries_total", role="prefill"), pd.metric(
        "pdserve_migrations_total")  # fmt: skip
    decode_before = _decode_snapshot(cluster)
    result: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: result.update(tokens=_generate(pd, prompt, 8, timeout=90)))
    received = _received(cluster)
    thread.start()
    deadline = time.monotonic() + 30
    while _received(cluster) == received:  # the first chunks' KV landed: mid-transfer
        assert time.monotonic() < deadline, "no KV ever reached a decode pod"
    victim.kill()
    thread.join(120)
    assert not thread.is_alive(), "the request hung after its prefill pod died"
    assert result["tokens"] == expected
    # one retry on another prefill pod, against the same decode pod's reservation:
    # no migration, one decode pod took exactly one transfer, no decode pod aborted
    assert pd.metric("pdserve_retries_total", role="prefill") == retries + 1
    assert pd.metric("pdserve_migrations_total") == migrations
    decode_after = _decode_snapshot(cluster)
    grew = [a[0] - b[0] for a, b in zip(decode_after, decode_before, strict=True)]
    assert sorted(grew) == [0.0, 0.0, 1.0]
    assert [a[1] for a in decode_after] == [b[1] for b in decode_before]
    # the decode pod that took it lost the killed sender mid-transfer, then the retry
    # restarted the same transfer from layer 0
    (taker,) = [i for i, g in enumerate(grew) if g]
    assert decode_after[taker][2] == decode_before[taker][2] + 1


def test_prefill_and_decode_pods_killed_during_a_run(cluster):
    pd = cluster["pd"]
    warm = "Which prefill pod takes this prompt?"
    # prefix affinity sends the same prompt to the same prefill pod: kill that one
    victim_prefill = _prefill_pod_for(cluster, warm)
    prompts = [warm] + [f"Request number {i} asks about topic {i * 7}" for i in range(7)]
    # long enough that the killed decode pod is still decoding what it
    # serves (80 tokens could all be out between the poll and the kill
    # under a loaded machine, leaving nothing to migrate)
    expected = {p: _generate(cluster["co"], p, 240) for p in prompts}
    results: dict[str, object] = {}
    migrations_before = pd.metric("pdserve_migrations_total")

    def client(prompt: str) -> None:
        try:
            results[prompt] = _generate(pd, prompt, 240, timeout=90)
        except grpc.RpcError as exc:  # a clear error is allowed; a hang is not
            results[prompt] = exc

    victim_prefill.kill()
    threads = []
    for i, prompt in enumerate(prompts):
        threads.append(threading.Thread(target=client, args=(prompt,)))
        threads[-1].start()
        if i == 3:  # kill a decode pod as soon as it is serving some of them
            deadline = time.monotonic() + 20
            while not (busy := [d for d in cluster["decode"] if _running(d) > 0]):
                assert time.monotonic() < deadline, "no decode pod ever got a request"
                time.sleep(0.01)
            busy[0].kill()
        time.sleep(0.1)
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a request hung after the kills"
    errors = {p: r for p, r in results.items() if isinstance(r, grpc.RpcError)}
    for error in errors.values():
        assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details()
    assert not errors, {p: e.details() for p, e in errors.items()}
    for prompt in prompts:
        assert results[prompt] == expected[prompt], prompt
    # The dead prefill pod costs a prefill retry, or nothing when the router's health
    # poll dropped it before any request was routed to it (timing-dependent): both
    # are right, so only the decode pod's death is counted.
    assert pd.metric("pdserve_migrations_total") > migrations_before
