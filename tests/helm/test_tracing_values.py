"""Tracing in the chart: off by default; `tracing.otlpEndpoint` gives every
role's container the OTEL_* environment the roles read (telemetry/tracing.py:
the endpoint, a parent-based ratio sampler at `tracing.sampleRatio`), and the
schema refuses a ratio outside [0, 1] or an endpoint that is not a URL."""

from __future__ import annotations

import pytest

from tests.helm.chart import PREFIX, RenderError, container, find, render

pytestmark = pytest.mark.timeout(60)
ROLES = ("router", "prefill", "decode")


def _env(docs, role: str) -> dict[str, str]:
    deployment = find(docs, "Deployment", f"{PREFIX}-{role}")
    return {e["name"]: e.get("value") for e in container(deployment, role)["env"]}


def test_tracing_is_off_by_default() -> None:
    docs = render()
    for role in ROLES:
        assert not [name for name in _env(docs, role) if name.startswith("OTEL_")]


def test_an_endpoint_turns_tracing_on_in_every_role() -> None:
    docs = render({"tracing": {"otlpEndpoint": "http://otel-collector:4317",
                               "sampleRatio": 0.25}})
    for role in ROLES:
        env = _env(docs, role)
        assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://otel-collector:4317"
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        assert float(env["OTEL_TRACES_SAMPLER_ARG"]) == 0.25
        assert "OTEL_SERVICE_NAME" not in env  # each role names itself pdserve-<role>


@pytest.mark.parametrize("tracing", [{"sampleRatio": 1.5}, {"otlpEndpoint": "collector:4317"}])
def test_bad_tracing_values_are_refused(tracing) -> None:
    with pytest.raises(RenderError):
        render({"tracing": {"otlpEndpoint": "http://c:4317", "sampleRatio": 1.0, **tracing}})
