"""Traces and timelines through a real disaggregated deployment (issue 39).

One module-scoped cluster of processes on loopback (tiny model): a router, a
prefill pod and two decode pods (TCP and gRPC KV connectors), all with
--otlp-endpoint pointing at a real OTLP/gRPC receiver in this process
(tests/telemetry/otlp_receiver.py), and the router with two named API keys.

Checked: one streamed request is one trace across router, prefill pod and
decode pod, parented router request -> attempt -> each pod's call, the
client's traceparent continued, and the KV send span's bytes equal what the
decode pod counted; the router's timeline (/debug/requests/{id},
`pdserve trace`) shows the request's phases to its own key only; a request
whose decode pod is killed with SIGKILL mid-stream shows both attempts in
one trace (last: it kills a pod).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.pods import REPO_ROOT, start_pods
from tests.router.router_process import start_router, wait_ready
from tests.telemetry.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY_A, KEY_B = "sk-aaaaaaaaaaaaaaaa", "sk-bbbbbbbbbbbbbbbb"
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
PROMPT = " ".join(f"w{i}" for i in range(40))
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "200"}  # ms: spans leave quickly


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    receiver = OtlpReceiver()
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"team-a {KEY_A}\nteam-b {KEY_B}\n")
    tracing = {"otlp_endpoint": receiver.endpoint}
    pods = start_pods({
        "prefill": ("prefill", {"block_size": 16, "num_blocks": 256, "kv_streams": 2,
                                "env": FAST_EXPORT, **tracing}),
        "d1": ("decode", {"block_size": 16, "num_blocks": 256, "env": FAST_EXPORT, **tracing}),
        # the gRPC KV connector's BEGIN carries the trace as the TCP one's does
        "d2": ("decode", {"block_size": 16, "num_blocks": 256, "kv_transport": "grpc",
                          "env": FAST_EXPORT, **tracing}),
    }, tiny_model_dir)
    router = None
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
            router = start_router(tiny_model_dir, prefill=[pods["prefill"].address],
                                  decode=[pods["d1"].address, pods["d2"].address],
                                  api_keys_file=str(keys), request_timeout=60, **tracing)
        wait_ready(router)
        yield receiver, router, pods
    finally:
        if router is not None:
            router.process.kill()
        for pod in pods.values():
            pod.kill()
        receiver.stop()


def _stream(router, key: str, max_tokens: int, headers: dict | None = None,
            on_chunk=None) -> tuple[str, int]:
    """A streamed completion; (the response id, chunks with text). `on_chunk(n)`
    after each chunk."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        router.url("/v1/completions"), data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}",
                 **(headers or {})})
    response_id, chunks = "", 0
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply:
            line = line.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: "):])
            assert "error" not in event, event
            response_id = event["id"]
            if event["choices"] and event["choices"][0].get("text"):
                chunks += 1
                if on_chunk is not None:
                    on_chunk(chunks)
    return response_id, chunks


def _timeline(router, request_id: str, key: str):
    request = urllib.request.Request(router.url(f"/debug/requests/{request_id}"),
                                     headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _kv_bytes(pods) -> float:
    return sum(pods[name].metric_value("pdserve_kv_transfer_bytes_total") for name in ("d1", "d2"))


def _one(spans, name: str, **where):
    found = [s for s in spans if s.name == name
             and all(s.attributes.get(k) == v for k, v in where.items())]
    assert len(found) == 1, (name, where, [(s.service, s.name) for s in spans])
    return found[0]


def test_one_streamed_request_is_one_trace_across_router_prefill_and_decode(cluster,
                                                                          tiny_model_dir):
    receiver, router, pods = cluster
    kv_before = _kv_bytes(pods)
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    response_id, chunks = _stream(router, KEY_A, 8, {"traceparent": parent})
    assert chunks >= 1
    wanted = {"pdserve.request", "pdserve.attempt", "prefill.request", "kv.send",
              "decode.request", "kv.receive_inject", "decode.generate"}
    receiver.wait_for(lambda: wanted <= {s.name for s in receiver.trace(CLIENT_TRACE)},
                      what=f"spans {sorted(wanted)} of trace {CLIENT_TRACE}")
    spans = receiver.trace(CLIENT_TRACE)
    request = _one(spans, "pdserve.request")
    assert request.service == "pdserve-router" and request.parent_id == CLIENT_SPAN
    assert request.attributes["pdserve.outcome"] == "ok"
    assert request.attributes["pdserve.path"] == "disaggregated"
    assert request.attributes["pdserve.model"] == "tiny"
    assert response_id.endswith(request.attributes["pdserve.request_id"])
    attempt = _one(spans, "pdserve.attempt")
    assert attempt.parent_id == request.span_id
    prefill = _one(spans, "prefill.request")
    decode = _one(spans, "decode.request")
    assert (prefill.service, decode.service) == ("pdserve-prefill", "pdserve-decode")
    # the prefill pod's from the gRPC metadata, the decode pod's from the KV BEGIN frame
    assert prefill.parent_id == decode.parent_id == attempt.span_id
    send = _one(spans, "kv.send")
    assert send.parent_id == prefill.span_id
    queue, compute = _one(spans, "prefill.queue_wait"), _one(spans, "prefill.compute")
    assert queue.parent_id == compute.parent_id == prefill.span_id
    assert queue.end_ns <= compute.start_ns  # the engine's first schedule between them
    for name in ("kv.receive_inject", "decode.first_step_wait", "decode.generate"):
        assert _one(spans, name).parent_id == decode.span_id
    assert send.attributes["pdserve.bytes"] > 0
    assert send.attributes["pdserve.bytes"] == _kv_bytes(pods) - kv_before
    # the decode pod's receive: one kv.layer event per layer, in order, whose
    # bytes add up to what was sent, arrived before injected (ms since BEGIN)
    receive = _one(spans, "kv.receive_inject")
    layers = [a for name, a in receive.event_attributes if name == "kv.layer"]
    num_layers = json.loads((Path(tiny_model_dir) / "config.json").read_text())[
        "num_hidden_layers"]
    assert [a["pdserve.layer"] for a in layers] == list(range(num_layers))
    assert sum(a["pdserve.bytes"] for a in layers) == send.attributes["pdserve.bytes"]
    assert all(0 <= a["pdserve.arrived_ms"] <= a["pdserve.injected_ms"] for a in layers)
    assert not receive.error and "kv.checksum_failure" not in receive.events
    assert any(s.name == "router.decoding" and s.parent_id == request.span_id for s in spans)


def test_timeline_endpoint_and_pdserve_trace_show_a_finished_request(cluster):
    receiver, router, _ = cluster
    response_id, _ = _stream(router, KEY_A, 4)
    status, shown = _timeline(router, response_id, KEY_A)
    assert status == 200, shown
    phases = [p["phase"] for p in shown["phases"]]
    for phase in ("routing", "admission_wait", "reserving", "prefilling", "decoding"):
        assert phase in phases, phases
    assert shown["outcome"] == "ok" and shown["path"] == "disaggregated"
    assert shown["prompt_tokens"] > 0 and shown["output_tokens"] == 4
    assert shown["attempts"][0]["kv_bytes"] > 0 and shown["attempts"][0]["prefill"]
    assert [e["event"] for e in shown["events"]] == ["first_token"]
    # no client traceparent: a new root at the router
    receiver.wait_for(lambda: any(s.name == "pdserve.request"
                                  for s in receiver.trace(shown["trace_id"])))
    assert _one(receiver.trace(shown["trace_id"]), "pdserve.request").parent_id == ""
    # another key neither sees it nor learns that it exists; an unknown id is a clear 404
    status, other = _timeline(router, response_id, KEY_B)
    assert status == 404 and "--trace-history" in other["error"]["message"]
    assert _timeline(router, "cmpl-nosuchrequest", KEY_A)[0] == 404
    command = [sys.executable, "-m", "pdserve", "trace", response_id,
               "--router", router.base_url, "--api-key", KEY_A]
    table = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "prefilling" in table.stdout and "duration ms" in table.stdout
    as_json = subprocess.run([*command, "--json"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=60)
    assert json.loads(as_json.stdout)["id"] == shown["id"]
    missing = subprocess.run([*command[:4], "cmpl-nosuchrequest", *command[5:]],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "HTTP 404" in missing.stderr


def test_a_router_with_two_workers_traces_from_each_worker(cluster, tiny_model_dir):
    """`--workers 2`: each worker process sets up its own tracer provider after
    the spawn (none is inherited), with its own service.instance.id; requests
    on new connections land on both workers (the kernel spreads them), and
    every one's router spans arrive, joined with the pods' by the trace."""
    receiver, _, pods = cluster
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        router = start_router(tiny_model_dir, prefill=[pods["prefill"].address],
                              decode=[pods["d1"].address, pods["d2"].address], workers=2,
                              request_timeout=60, otlp_endpoint=receiver.endpoint)
    try:
        wait_ready(router)
        instances: set[str] = set()
        for batch in range(8):  # both workers seen: 1 - 2**-(4n) likely after n batches
            trace_ids = [f"{0xabc0000 + 4 * batch + i:032x}" for i in range(4)]
            for trace_id in trace_ids:  # urllib: a new connection per request
                _complete(router, {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"})

            def traced(ids: list[str] = trace_ids) -> bool:
                return all(any(s.name == "pdserve.request" for s in receiver.trace(t))
                           and any(s.name == "prefill.request" for s in receiver.trace(t))
                           for t in ids)
            receiver.wait_for(traced, what=f"the router's spans of {trace_ids}")
            for trace_id in trace_ids:
                request = _one(receiver.trace(trace_id), "pdserve.request")
                assert request.service == "pdserve-router" and request.parent_id == CLIENT_SPAN
                instances.add(request.instance)
            if len(instances) == 2:
                break
        assert instances == {"127.0.0.1:0/worker-0", "127.0.0.1:0/worker-1"}
        assert router.terminate() == 0
    finally:
        if router.process.poll() is None:
            router.process.kill()


def _complete(router, headers: dict) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    request = urllib.request.Request(
        router.url("/v1/completions"), data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200


def test_a_request_moved_off_a_killed_decode_pod_shows_both_attempts(cluster):
    receiver, router, pods = cluster
    killed: list[str] = []

    def kill_the_busy_decode_pod(chunks: int) -> None:
        if killed or chunks < 5:
            return
        for name in ("d1", "d2"):
            if pods[name].metric_value("pdserve_requests_running") > 0:
                pods[name].process.kill()  # SIGKILL
                killed.append(name)
                return

    response_id, chunks = _stream(router, KEY_A, 200, on_chunk=kill_the_busy_decode_pod)
    assert killed, "no decode pod was running the request"
    status, shown = _timeline(router, response_id, KEY_A)
    assert status == 200 and shown["outcome"] == "ok"
    assert len(shown["attempts"]) == 2, shown["attempts"]
    assert shown["attempts"][0]["decode"] == pods[killed[0]].address
    assert "failure" in shown["attempts"][0]
    assert shown["attempts"][1]["decode"] != pods[killed[0]].address
    assert "migration" in [e["event"] for e in shown["events"]]
    trace_id = shown["trace_id"]

    def both_attempts_in():
        spans = receiver.trace(trace_id)
        return (len([s for s in spans if s.name == "pdserve.attempt"]) == 2
                and any(s.name == "pdserve.request" for s in spans)
                and len([s for s in spans if s.name == "prefill.request"]) == 2
                # the surviving decode pod's: exported on its own batch schedule
                and any(s.name == "decode.request" for s in spans))
    receiver.wait_for(both_attempts_in, what="both attempts' spans")
    spans = receiver.trace(trace_id)
    request = _one(spans, "pdserve.request")
    assert "migration" in request.events
    first, second = sorted((s for s in spans if s.name == "pdserve.attempt"),
                           key=lambda s: s.start_ns)
    assert first.parent_id == second.parent_id == request.span_id
    assert first.error and not second.error
    # the surviving decode pod's spans are the second attempt's
    decode = [s for s in spans if s.name == "decode.request"]
    assert [s.parent_id for s in decode] == [second.span_id]
