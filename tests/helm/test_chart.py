"""Static checks of helm/pdserve: metadata, values vs schema, and template text.

These need no Helm at all, so they run everywhere; tests/helm/test_render.py
renders the chart for real.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from typing import Any

import pytest
import yaml

from tests.helm.chart import (
    CHART_DIR,
    CLI_FLAGS,
    TEMPLATES_DIR,
    deep_merge,
    load_schema,
    load_values,
)

TEMPLATE_FILES = sorted(TEMPLATES_DIR.glob("*.yaml")) + [
    TEMPLATES_DIR / "_helpers.tpl",
    TEMPLATES_DIR / "NOTES.txt",
]
# Template file -> the `pdserve` subcommand its main container runs.
COMMAND_OF_TEMPLATE = {
    "deployment-router.yaml": "router",
    "deployment-prefill.yaml": "prefill",
    "deployment-decode.yaml": "decode",
    "_helpers.tpl": "make-model",
}
BLOCK_OPENERS = ("if", "range", "with", "define", "block")
ACTION_RE = re.compile(r"{{-?\s*(/\*.*?\*/|[^}]*?)\s*-?}}", re.S)
VALUES_REF_RE = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
ALIAS_RE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)\s*:=\s*\$?\.Values((?:\.[A-Za-z_]\w*)+)")
FLAG_RE = re.compile(r'^\s*- "(--[a-z][a-z0-9-]*)(?:=.*)?"\s*$', re.M)
SUBCOMMAND_RE = re.compile(r'args:\s*\n\s*- "([a-z-]+)"')


def _validator() -> Any:
    # Only the schema tests need jsonschema; the text checks run without it.
    jsonschema = importlib.import_module("jsonschema")
    schema = load_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _resolve(values: dict[str, Any], path: list[str]) -> bool:
    node: Any = values
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def _values_references(text: str, alias_bases: bool = True) -> set[tuple[str, ...]]:
    """Every `.Values.a.b` path in a template, with `$x := .Values.a` aliases expanded.

    With `alias_bases=False` the `.Values.a` of an alias assignment does not
    count itself, only the `$x.b` paths used through it.
    """
    assigned = {m.start(2) for m in ALIAS_RE.finditer(text)}
    refs = {
        tuple(m.group(1)[1:].split(".")) for m in VALUES_REF_RE.finditer(text)
        if alias_bases or m.start(1) not in assigned
    }
    for alias in ALIAS_RE.finditer(text):
        name, base = alias.group(1), tuple(alias.group(2)[1:].split("."))
        for use in re.finditer(rf"\${name}((?:\.[A-Za-z_]\w*)+)", text):
            refs.add(base + tuple(use.group(1)[1:].split(".")))
    return refs


def _leaf_paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(node, dict) and node:
        return [p for key, child in node.items() for p in _leaf_paths(child, prefix + (key,))]
    return [prefix]


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "pdserve"
    assert chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    assert isinstance(chart["appVersion"], str) and chart["appVersion"]


def test_default_values_satisfy_schema() -> None:
    errors = list(_validator().iter_errors(load_values()))
    assert errors == []


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ({"decode": {"kvTransport": "udp"}}, ["decode", "kvTransport"]),
        ({"prefill": {"blockSize": 24}}, ["prefill", "blockSize"]),
        ({"decode": {"replicas": 0}}, ["decode", "replicas"]),
        ({"prefill": {"device": "tpu"}}, ["prefill", "device"]),
        ({"prefill": {"dtype": "int8"}}, ["prefill", "dtype"]),
        ({"prefill": {"kvStreams": 0}}, ["prefill", "kvStreams"]),
        ({"prefill": {"kvCacheMemory": "2 gigs"}}, ["prefill", "kvCacheMemory"]),
        ({"prefill": {"kvCacheMemory": "2TB"}}, ["prefill", "kvCacheMemory"]),
        ({"prefill": {"device": "cuda:1"}}, ["prefill", "device"]),
        ({"decode": {"landingMemory": ""}}, ["decode", "landingMemory"]),
        ({"router": {"port": 70000}}, ["router", "port"]),
        ({"router": {"replicsa": 2}}, ["router"]),
        ({"router": {"service": {"type": "Ingress"}}}, ["router", "service", "type"]),
        ({"model": {"source": "s3"}}, ["model", "source"]),
        ({"model": {"dir": "../etc"}}, ["model", "dir"]),
        ({"model": {"source": "pvc"}}, ["model", "pvc", "claimName"]),
        ({"model": {"source": "hostPath"}}, ["model", "hostPath", "path"]),
        ({"model": {"demo": {"model": "huge"}}}, ["model", "demo", "model"]),
        ({"redis": {"externalUrl": "my-redis:6379"}}, ["redis", "externalUrl"]),
        ({"tls": {"pods": {"healthPort": 0}}}, ["tls", "pods", "healthPort"]),
        ({"tls": {"pods": {"serverName": "Not A Name"}}}, ["tls", "pods", "serverName"]),
        ({"tls": {"router": {"secretName": "Bad_Name"}}}, ["tls", "router", "secretName"]),
        ({"tls": {"router": {"ca": "x"}}}, ["tls", "router"]),
        ({"podToken": {"value": "two words"}}, ["podToken", "value"]),
        ({"router": {"splitPrefillMinTokens": "always"}}, ["router", "splitPrefillMinTokens"]),
        ({"router": {"splitPrefillMinTokens": -1}}, ["router", "splitPrefillMinTokens"]),
        ({"networkPolicy": {"metricsFrom": "monitoring"}}, ["networkPolicy", "metricsFrom"]),
        ({"metrics": {"serviceMonitor": {"interval": "often"}}},
         ["metrics", "serviceMonitor", "interval"]),
        ({"decode": {"autoscaling": {"maxReplicas": 0}}}, ["decode", "autoscaling", "maxReplicas"]),
        ({"prefill": {"autoscaling": {"targetCPUUtilizationPercentage": 101}}},
         ["prefill", "autoscaling", "targetCPUUtilizationPercentage"]),
    ],
)
def test_schema_rejects(override: dict[str, Any], path: list[str]) -> None:
    values = deep_merge(load_values(), override)
    errors = list(_validator().iter_errors(values))
    assert errors, f"schema accepted {override}"
    # The error (or, under allOf/if-then, one of its causes) names the bad key.
    paths = {tuple(e.absolute_path) for err in errors for e in [err, *(err.context or [])]}
    assert tuple(path) in paths, paths


def test_schema_accepts_gpu_and_redis_values() -> None:
    override = {
        "prefill": {
            "replicas": 3,
            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}},
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}],
            "autoscaling": {"enabled": True},
        },
        "decode": {"kvTransport": "grpc", "kvCacheMemory": "60GiB", "blockSize": 256},
        "redis": {"enabled": True},
        "model": {"source": "pvc", "pvc": {"claimName": "models"}, "dir": "llama/3.1-8b"},
    }
    assert list(_validator().iter_errors(deep_merge(load_values(), override))) == []


@pytest.mark.parametrize("template", TEMPLATE_FILES, ids=lambda p: p.name)
def test_values_references_exist(template: Any) -> None:
    values = load_values()
    missing = sorted(
        ".".join(ref) for ref in _values_references(template.read_text())
        if not _resolve(values, list(ref))
    )
    assert missing == []


def test_every_value_is_used_by_a_template() -> None:
    refs: set[tuple[str, ...]] = set()
    for template in TEMPLATE_FILES:
        refs |= _values_references(template.read_text(), alias_bases=False)
    # A value counts as used when it or a map above it is referenced
    # (resources, nodeSelector and the like are passed whole).
    unused = [
        ".".join(leaf) for leaf in _leaf_paths(load_values())
        if not any(leaf[:n] in refs for n in range(1, len(leaf) + 1))
    ]
    assert unused == []


@pytest.mark.parametrize("template", TEMPLATE_FILES, ids=lambda p: p.name)
def test_template_actions_balance(template: Any) -> None:
    text = template.read_text()
    assert text.count("{{") == text.count("}}")
    depth = 0
    for action in ACTION_RE.finditer(text):
        body = action.group(1)
        if body.startswith("/*"):
            continue
        keyword = body.split(maxsplit=1)[0] if body.split() else ""
        if keyword in BLOCK_OPENERS:
            depth += 1
        elif keyword == "end":
            depth -= 1
            assert depth >= 0, f"unmatched end at offset {action.start()}"
    assert depth == 0, f"{depth} unclosed block(s)"


@pytest.mark.parametrize(("template", "command"), sorted(COMMAND_OF_TEMPLATE.items()))
def test_flags_are_in_cli_contract(template: str, command: str) -> None:
    text = (TEMPLATES_DIR / template).read_text()
    assert SUBCOMMAND_RE.search(text).group(1) == command
    flags = set(FLAG_RE.findall(text))
    assert flags - CLI_FLAGS[command] == set()
    # Required flags of each role are always passed.
    required = {
        "router": {"--model", "--host", "--port", "--grpc-port"},
        "prefill": {"--model", "--host", "--port", "--metrics-port", "--advertise-host",
                    "--grace-period"},
        "decode": {"--model", "--host", "--port", "--kv-port", "--metrics-port",
                   "--advertise-host", "--grace-period"},
        "make-model": {"--from-gguf"},  # the default demo model
    }[command]
    assert required <= flags


@pytest.mark.parametrize("template", ["deployment-prefill.yaml", "deployment-decode.yaml",
                                      "deployment-router.yaml", "deployment-redis.yaml"])
def test_probe_ports_are_container_ports(template: str) -> None:
    text = (TEMPLATES_DIR / template).read_text()
    container_ports = set(re.findall(r"containerPort: ({{[^}]*}})", text))
    probe_ports = re.findall(r"(?:grpc|httpGet|tcpSocket):\n(?:\s+path: \S+\n)?\s+port: (\S.*)",
                             text)
    assert probe_ports, "no probes found"
    assert set(probe_ports) <= container_ports
    if "pdserve.probePort" in text:
        # pdserve pods: every probe targets the port their health service is
        # on, the --port, or with pod TLS the plaintext --health-port
        # (pdserve.probePort; tests/helm/test_render.py checks the numbers)
        assert set(probe_ports) == {"{{ $probePort }}"}
        assert '"--health-port={{ .Values.tls.pods.healthPort }}"' in text


@pytest.mark.parametrize(("template", "command"), sorted(COMMAND_OF_TEMPLATE.items()))
def test_flags_exist_in_command_parser(template: str, command: str) -> None:
    """The command's own argparse parser accepts every flag the chart passes."""
    module_name = "pdserve.commands." + command.replace("-", "_")
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"pdserve {command}")
    module.add_arguments(parser)
    flags = set(FLAG_RE.findall((TEMPLATES_DIR / template).read_text()))
    assert flags - set(parser._option_string_actions) == set()
