"""telemetry.tracing: off by default (no SDK, no provider, no exporter), on
with --otlp-endpoint or the OTEL_* environment; the W3C parsing and the
router's timeline ring (telemetry.context, telemetry.history)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from telemetry.context import TraceOrigin, from_headers, from_metadata, parse_traceparent
from telemetry.history import History, Timeline
from telemetry.tracing import TraceConfig

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROBE = """
import json, sys
from telemetry import tracing
on = tracing.setup(tracing.TraceConfig(endpoint=sys.argv[1], sample_ratio=None), role="prefill",
                   address="127.0.0.1:1", model="tiny")
from opentelemetry import trace
provider = trace.get_tracer_provider()
print(json.dumps({
    "on": on, "tracer": tracing.tracer() is not None,
    "sdk": any(m.startswith("opentelemetry.sdk") for m in sys.modules),
    "exporter": any(m.startswith("opentelemetry.exporter") for m in sys.modules),
    "global_provider": type(provider).__name__,
    "resource": dict(tracing._provider.resource.attributes) if on else None,
}))
tracing.shutdown()
"""


def _probe(endpoint: str = "", **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", _PROBE, endpoint], cwd=REPO, check=True,
                         capture_output=True, text=True, env={**clean, **env}, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_off_by_default_creates_no_provider_and_no_exporter():
    result = _probe()
    assert result == {"on": False, "tracer": False, "sdk": False, "exporter": False,
                      "global_provider": "ProxyTracerProvider", "resource": None}


def test_on_with_the_flag_or_the_environment():
    # nothing listens there: the batch exporter only logs its failures
    flagged = _probe("http://127.0.0.1:9")
    assert flagged["on"] and flagged["sdk"] and flagged["exporter"]
    assert flagged["resource"]["service.name"] == "pdserve-prefill"
    assert flagged["resource"]["pdserve.role"] == "prefill"
    assert flagged["resource"]["pdserve.model"] == "tiny"
    env = _probe(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://127.0.0.1:9",
                 OTEL_SERVICE_NAME="mine", OTEL_RESOURCE_ATTRIBUTES="team=a")
    assert env["on"] and env["resource"]["service.name"] == "mine"
    assert env["resource"]["team"] == "a"


def test_a_sample_ratio_outside_0_1_is_refused():
    with pytest.raises(ValueError, match=r"--trace-sample-ratio must be in \[0, 1\], got 1.5"):
        TraceConfig(sample_ratio=1.5)


def test_traceparent_parsing_follows_w3c():
    parent = parse_traceparent(PARENT)
    assert parent.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and parent.sampled
    assert parent.header() == PARENT
    for bad in ("", "00-abc", PARENT.upper(), "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"):
        assert parse_traceparent(bad) is None, bad
    origin = from_headers({"traceparent": PARENT, "tracestate": "a=b"}, "team-a", "tiny")
    assert origin == TraceOrigin(PARENT, "a=b", "team-a", "tiny")
    assert from_headers({"traceparent": "junk", "tracestate": "a=b"}) == TraceOrigin()
    assert from_metadata((("traceparent", PARENT), ("authorization", "x"))) == {
        "traceparent": PARENT}
    assert from_metadata((("traceparent", "junk"),)) == {}
    assert from_metadata(None) == {}


def test_history_keeps_the_last_n_and_accepts_the_response_id():
    history = History(2)
    for name in ("a", "b", "c"):
        timeline = Timeline(name, key_name="k")
        timeline.enter("routing")
        timeline.enter("decoding")
        timeline.finish("ok")
        history.add(timeline)
    assert len(history) == 2 and history.find("a") is None
    assert history.find("chatcmpl-b") is history.find("cmpl-b") is history.find("b")
    shown = history.find("c").to_json()
    assert [p["phase"] for p in shown["phases"]] == ["routing", "decoding"]
    assert shown["outcome"] == "ok" and shown["phases"][1]["duration_ms"] >= 0
    off = History(0)
    off.add(Timeline("x"))
    assert off.find("x") is None
    with pytest.raises(ValueError, match=r"--trace-history must be in \[0, 1000000\], got -1"):
        History(-1)


def test_pdserve_up_passes_the_tracing_flags_to_every_child():
    import argparse

    from pdserve.commands import up
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    config = up.config_from_args(parser.parse_args(
        ["--otlp-endpoint", "http://collector:4317", "--trace-sample-ratio", "0.25"]))
    flags = ("--otlp-endpoint", "http://collector:4317", "--trace-sample-ratio", "0.25")
    assert config.pod_args == flags and config.router_args == flags
    off = up.config_from_args(parser.parse_args([]))
    assert off.pod_args == off.router_args == ()


_FORK_PROBE = """
import os, sys
from telemetry import tracing
assert tracing.setup(tracing.TraceConfig(endpoint="http://127.0.0.1:9"), role="router",
                     address="127.0.0.1:8000", instance="worker-3")
print(dict(tracing._provider.resource.attributes)["service.instance.id"])
pid = os.fork()
if pid == 0:  # the child never uses the parent's provider or exporter
    os._exit(0 if tracing.tracer() is None and tracing._provider is None else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), "parent", tracing.tracer() is not None)
tracing.shutdown()
"""


def test_a_forked_child_forgets_the_parents_provider_and_an_instance_is_named():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", _FORK_PROBE], cwd=REPO, check=True,
                         capture_output=True, text=True, env=clean, timeout=60).stdout
    assert out.split("\n")[:2] == ["127.0.0.1:8000/worker-3", "child 0 parent True"]
