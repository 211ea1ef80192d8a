"""Shared access to helm/pdserve for the chart tests.

Static tests read the chart's files directly (PyYAML, jsonschema). Render
tests go through `render()`, which uses the `helm` binary when it is on PATH
and otherwise Helm's own Go engine through the `helm-python-sdk` wheel
(`helm_python`); with neither, render tests skip.
"""

from __future__ import annotations

import copy
import importlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "pdserve"
TEMPLATES_DIR = CHART_DIR / "templates"
RELEASE = "demo"
NAMESPACE = "ns"
PREFIX = "demo-pdserve"

# The CLI contract of each `pdserve` subcommand the chart runs (owned by the
# command modules; the chart must not pass anything else).
POD_SECURITY_FLAGS = frozenset({
    "--tls-cert-file", "--tls-key-file", "--tls-ca-file", "--tls-server-name",
    "--no-tls-client-cert", "--pod-token-file", "--health-port", "--no-kv-tls",
})
CLI_FLAGS: dict[str, frozenset[str]] = {
    "router": frozenset({
        "--model", "--served-model-name", "--host", "--port", "--grpc-port", "--prefill",
        "--decode", "--redis-url", "--api-key", "--session-epsilon", "--load-poll-interval",
        "--workers", "--prefill-dispatch-tokens", "--prefill-dispatch-seconds",
        "--max-queue-wait",
        "--tls-cert-file", "--tls-key-file", "--pod-tls-ca-file", "--pod-tls-server-name",
        "--pod-tls-cert-file", "--pod-tls-key-file", "--pod-token-file",
        "--http-header-timeout", "--http-keepalive-timeout", "--max-concurrent-per-client",
        "--routing-policy", "--local-prefill-below", "--local-prefill-max-tokens",
        "--local-prefill-min-wait", "--split-prefill-min-tokens",
        "--split-prefill-head-share", "--split-prefill-busy-head-share",
        "--split-prefill-max-running", "--no-local-prefill-within-budget",
        "--no-local-prefill-warm", "--no-warm-session-answers",
        "--registry-absent-grace", "--api-keys-file",
    }),
    "prefill": frozenset({
        "--model", "--host", "--port", "--metrics-port", "--block-size", "--kv-cache-memory",
        "--device", "--dtype", "--kv-streams", "--redis-url", "--advertise-host",
        "--tensor-parallel-size",
        "--grace-period", *POD_SECURITY_FLAGS,
    }),
    "decode": frozenset({
        "--model", "--host", "--port", "--kv-port", "--metrics-port", "--block-size",
        "--kv-transport", "--kv-cache-memory", "--landing-memory", "--transfer-timeout",
        "--reservation-timeout", "--redis-url", "--advertise-host", "--grace-period",
        "--kv-max-connections", "--kv-frame-timeout", "--tensor-parallel-size",
        "--itl-budget-ms", "--kv-auth-timeout", "--kv-max-pending", "--kv-max-pending-per-peer",
        *POD_SECURITY_FLAGS,
    }),
    "make-model": frozenset({"--size", "--from-gguf"}),
}


def load_values() -> dict[str, Any]:
    return yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def load_schema() -> dict[str, Any]:
    return json.loads((CHART_DIR / "values.schema.json").read_text())


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override` merged in the way Helm merges --set/-f values."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


class RenderError(Exception):
    """Helm refused to render (schema violation or a template's `fail`)."""


def _render_with_binary(helm: str, values: dict[str, Any]) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(values, f)
    proc = subprocess.run(
        [helm, "template", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE, "-f", f.name],
        capture_output=True, text=True, timeout=60,
    )
    Path(f.name).unlink()
    if proc.returncode != 0:
        raise RenderError(proc.stderr)
    return proc.stdout


def _render_with_sdk(values: dict[str, Any]) -> str:
    helm_python = importlib.import_module("helm_python")
    try:
        with helm_python.Chart.load(str(CHART_DIR)) as chart:
            manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    except helm_python.HelmError as exc:
        raise RenderError(str(exc)) from exc
    # NOTES.txt is not a manifest; `helm template` leaves it out too.
    return "\n---\n".join(
        text for name, text in sorted(manifests.items()) if not name.endswith("NOTES.txt")
    )


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders with `values` over its defaults."""
    helm = shutil.which("helm")
    values = values or {}
    text = _render_with_binary(helm, values) if helm else _render_with_sdk(values)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    matches = [c for c in containers if c["name"] == name]
    assert len(matches) == 1, f"expected one container {name}"
    return matches[0]


# flags passed without a value
SWITCHES = frozenset({"--no-tls-client-cert", "--no-kv-tls", "--no-local-prefill-within-budget",
                      "--no-local-prefill-warm", "--no-warm-session-answers"})


def flag_values(args: list[str]) -> dict[str, str]:
    """`--flag=value` arguments as a dict (the chart passes every flag that way,
    but the `SWITCHES`, which map to "")."""
    out = {}
    for arg in args[1:]:
        flag, sep, value = arg.partition("=")
        assert sep or flag in SWITCHES, f"argument {arg!r} is not --flag=value"
        out[flag] = value
    return out
