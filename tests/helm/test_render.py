"""Render helm/pdserve with Helm's engine and check the Kubernetes objects.

Uses the `helm` binary when present, else the helm-python-sdk wheel; skips
without either (see tests/helm/chart.py).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto.tls import PodSecurity, TlsFiles, add_port, pod_channel
from tests.helm.chart import (
    CHART_DIR,
    CLI_FLAGS,
    NAMESPACE,
    PREFIX,
    RenderError,
    container,
    find,
    flag_values,
    render,
)

pytestmark = pytest.mark.timeout(60)

REDIS = {"redis": {"enabled": True}}
REDIS_URL = f"redis://{PREFIX}-redis.{NAMESPACE}.svc.cluster.local:6379/0"


def _kinds(docs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((d["kind"], d["metadata"]["name"]) for d in docs)


def _args(docs: list[dict[str, Any]], role: str) -> dict[str, str]:
    main = container(find(docs, "Deployment", f"{PREFIX}-{role}"), role)
    assert main["command"] == ["pdserve"]
    assert main["args"][0] == role
    flags = flag_values(main["args"])
    assert set(flags) <= CLI_FLAGS[role]
    return flags


def test_default_render_objects() -> None:
    assert _kinds(render()) == [
        ("Deployment", f"{PREFIX}-decode"),
        ("Deployment", f"{PREFIX}-prefill"),
        ("Deployment", f"{PREFIX}-router"),
        ("NetworkPolicy", f"{PREFIX}-decode"),
        ("NetworkPolicy", f"{PREFIX}-prefill"),
        ("PodDisruptionBudget", f"{PREFIX}-decode"),
        ("PodDisruptionBudget", f"{PREFIX}-prefill"),
        ("PodDisruptionBudget", f"{PREFIX}-router"),
        ("Secret", f"{PREFIX}-pod-tls"),
        ("Service", f"{PREFIX}-decode"),
        ("Service", f"{PREFIX}-prefill"),
        ("Service", f"{PREFIX}-router"),
    ]


def test_static_mode_router_gets_headless_service_addresses() -> None:
    assert _args(render(), "router") == {
        "--model": "/models/smollm2-135m-instruct",
        "--host": "0.0.0.0",
        "--port": "8000",
        "--grpc-port": "50050",
        "--prefill": f"{PREFIX}-prefill.{NAMESPACE}.svc.cluster.local:50051",
        "--decode": f"{PREFIX}-decode.{NAMESPACE}.svc.cluster.local:50061",
        "--session-epsilon": "0.25",
        "--load-poll-interval": "0.5",
        "--workers": "1",
        "--prefill-dispatch-tokens": "4096",
        "--prefill-dispatch-seconds": "1",
        "--max-queue-wait": "30",
        "--pod-tls-ca-file": f"{POD_TLS_DIR}/ca.crt",
        "--pod-tls-server-name": "pdserve-pod",
        "--pod-tls-cert-file": f"{POD_TLS_DIR}/tls.crt",
        "--pod-tls-key-file": f"{POD_TLS_DIR}/tls.key",
        "--http-header-timeout": "30",
        "--http-keepalive-timeout": "75",
        "--max-concurrent-per-client": "0",
        "--routing-policy": "first-tokens",
        "--local-prefill-below": "0",
        "--local-prefill-max-tokens": "2048",
        "--local-prefill-min-wait": "2",
        "--split-prefill-min-tokens": "auto",
        "--split-prefill-head-share": "0.55",
        "--split-prefill-busy-head-share": "0.7",
        "--split-prefill-max-running": "3",
        "--registry-absent-grace": "10",
    }


POD_TLS_DIR = "/etc/pdserve/pod-tls"
# pod gRPC by default: mutual TLS with the chart's generated certificate
POD_TLS_FLAGS = {"--tls-cert-file": f"{POD_TLS_DIR}/tls.crt",
                 "--tls-key-file": f"{POD_TLS_DIR}/tls.key",
                 "--tls-ca-file": f"{POD_TLS_DIR}/ca.crt", "--tls-server-name": "pdserve-pod",
                 "--health-port": "50070"}


def test_default_prefill_and_decode_args() -> None:
    docs = render()
    assert _args(docs, "prefill") == {
        "--model": "/models/smollm2-135m-instruct", "--host": "0.0.0.0", "--port": "50051",
        "--metrics-port": "9101", "--block-size": "16", "--kv-cache-memory": "2GiB",
        "--device": "auto", "--dtype": "auto", "--kv-streams": "4",
        "--advertise-host": "$(POD_IP)", "--grace-period": "30",
        "--tensor-parallel-size": "1", **POD_TLS_FLAGS,
    }
    assert _args(docs, "decode") == {
        "--model": "/models/smollm2-135m-instruct", "--host": "0.0.0.0", "--port": "50061",
        "--metrics-port": "9102", "--kv-port": "50062", "--block-size": "128",
        "--kv-transport": "tcp", "--landing-memory": "1GiB", "--transfer-timeout": "30",
        "--reservation-timeout": "600", "--advertise-host": "$(POD_IP)", "--grace-period": "30",
        "--kv-max-connections": "256", "--kv-frame-timeout": "10",
        "--tensor-parallel-size": "1", "--itl-budget-ms": "auto", "--kv-auth-timeout": "5",
        "--kv-max-pending": "256", "--kv-max-pending-per-peer": "64", **POD_TLS_FLAGS,
    }
    for role in ("prefill", "decode"):
        env = container(find(docs, "Deployment", f"{PREFIX}-{role}"), role)["env"]
        pod_ip = next(e for e in env if e["name"] == "POD_IP")
        assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"prefill": {"replicas": 2}}, "prefill.replicas is 2, but without Redis"),
        ({"decode": {"replicas": 3}}, "decode.replicas is 3, but without Redis"),
        ({"decode": {"autoscaling": {"enabled": True}}},
         "decode.autoscaling.enabled needs Redis"),
        ({**REDIS, "prefill": {"autoscaling": {
            "enabled": True, "podMetric": {"name": ""}}}},
         "prefill.autoscaling.enabled needs a metric"),
        ({**REDIS, "decode": {"autoscaling": {"enabled": True, "minReplicas": 5}}},
         "decode.autoscaling.maxReplicas (4) is below minReplicas (5)"),
        ({"decode": {"kvTransport": "udp"}}, "/decode/kvTransport"),
        ({"tls": {"router": {"enabled": True}}}, "tls.router.enabled needs tls.router.secretName"),
        ({"tls": {"pods": {"enabled": False}}, "podToken": {"value": "t"}},
         "podToken needs tls.pods.enabled"),
        ({"tls": {"pods": {"enabled": False}}, "podToken": {"existingSecret": "tokens"}},
         "podToken needs tls.pods.enabled"),
    ],
)
def test_render_refuses(values: dict[str, Any], message: str) -> None:
    with pytest.raises(RenderError, match=re.escape(message)):
        render(values)


def test_redis_mode_registers_every_role() -> None:
    docs = render({**REDIS, "prefill": {"replicas": 3}, "decode": {"replicas": 2}})
    assert find(docs, "Deployment", f"{PREFIX}-prefill")["spec"]["replicas"] == 3
    assert find(docs, "Deployment", f"{PREFIX}-decode")["spec"]["replicas"] == 2
    router = _args(docs, "router")
    assert router["--redis-url"] == REDIS_URL
    assert "--prefill" not in router and "--decode" not in router
    assert _args(docs, "prefill")["--redis-url"] == REDIS_URL
    assert _args(docs, "decode")["--redis-url"] == REDIS_URL
    redis = find(docs, "Deployment", f"{PREFIX}-redis")
    assert redis["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    service = find(docs, "Service", f"{PREFIX}-redis")
    assert service["spec"]["ports"] == [
        {"name": "redis", "port": 6379, "targetPort": "redis", "protocol": "TCP"}
    ]


def test_external_redis_replaces_the_chart_redis() -> None:
    url = "redis://shared-redis.infra:6379/2"
    docs = render({"redis": {"enabled": True, "externalUrl": url}, "decode": {"replicas": 2}})
    assert ("Deployment", f"{PREFIX}-redis") not in _kinds(docs)
    assert ("Service", f"{PREFIX}-redis") not in _kinds(docs)
    assert _args(docs, "router")["--redis-url"] == url
    assert _args(docs, "decode")["--redis-url"] == url


def test_autoscaling_per_component() -> None:
    docs = render({**REDIS, "prefill": {"autoscaling": {
        "enabled": True, "minReplicas": 2, "maxReplicas": 6,
        "targetCPUUtilizationPercentage": 70}}})
    hpa = find(docs, "HorizontalPodAutoscaler", f"{PREFIX}-prefill")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": f"{PREFIX}-prefill"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"] == [
        {"type": "Pods", "pods": {"metric": {"name": "pdserve_requests_waiting"},
                                  "target": {"type": "AverageValue", "averageValue": "4"}}},
        {"type": "Resource", "resource": {"name": "cpu", "target": {
            "type": "Utilization", "averageUtilization": 70}}},
    ]
    # The HPA owns the prefill replica count; decode keeps its fixed one.
    assert "replicas" not in find(docs, "Deployment", f"{PREFIX}-prefill")["spec"]
    assert find(docs, "Deployment", f"{PREFIX}-decode")["spec"]["replicas"] == 1
    assert ("HorizontalPodAutoscaler", f"{PREFIX}-decode") not in _kinds(docs)


def _probe_ports(c: dict[str, Any]) -> list[Any]:
    ports = []
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        for action in ("grpc", "httpGet", "tcpSocket"):
            if probe in c and action in c[probe]:
                ports.append(c[probe][action]["port"])
    return ports


@pytest.mark.parametrize("ports", [{}, {"prefill": {"port": 6000, "metricsPort": 6001},
                                        "decode": {"port": 7000, "kvPort": 7001},
                                        "router": {"port": 8080}}])
def test_probes_target_container_ports(ports: dict[str, Any]) -> None:
    docs = render({**REDIS, **ports})
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            declared = {p["containerPort"] for p in c["ports"]} | {p["name"] for p in c["ports"]}
            probed = _probe_ports(c)
            assert probed and set(probed) <= declared, (deployment["metadata"]["name"], probed)
            if c["name"] == "router":
                assert set(probed) == {int(flag_values(c["args"])["--port"])}
            elif c["name"] in ("prefill", "decode"):  # pod TLS (default): the health port
                assert set(probed) == {int(flag_values(c["args"])["--health-port"])}
    decode = container(find(docs, "Deployment", f"{PREFIX}-decode"), "decode")
    assert {p["name"]: p["containerPort"] for p in decode["ports"]} == {
        "grpc": ports.get("decode", {}).get("port", 50061),
        "kv": ports.get("decode", {}).get("kvPort", 50062),
        "metrics": 9102,
        "health": 50070,
    }


def test_termination_grace_exceeds_drain_period() -> None:
    docs = render({"prefill": {"gracePeriod": 120}})
    for role, grace in (("prefill", 120), ("decode", 30)):
        pod = find(docs, "Deployment", f"{PREFIX}-{role}")["spec"]["template"]["spec"]
        assert flag_values(container({"spec": {"template": {"spec": pod}}}, role)["args"])[
            "--grace-period"] == str(grace)
        assert pod["terminationGracePeriodSeconds"] == grace + 15


def test_gpu_scheduling_is_per_component() -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    docs = render({"decode": {
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [toleration],
    }})
    decode = find(docs, "Deployment", f"{PREFIX}-decode")["spec"]["template"]["spec"]
    # Helm merges the GPU limit into the default requests and limits.
    assert container({"spec": {"template": {"spec": decode}}}, "decode")["resources"] == {
        "requests": {"cpu": "1", "memory": "4Gi"},
        "limits": {"memory": "8Gi", "nvidia.com/gpu": 1},
    }
    assert decode["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert decode["tolerations"] == [toleration]
    prefill = find(docs, "Deployment", f"{PREFIX}-prefill")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(prefill)
    assert "tolerations" not in prefill


def test_api_key_from_inline_value_and_existing_secret() -> None:
    docs = render({"router": {"apiKey": {"value": "s3cret"}}})
    secret = find(docs, "Secret", f"{PREFIX}-api-key")
    assert base64.b64decode(secret["data"]["api-key"]) == b"s3cret"
    env = container(find(docs, "Deployment", f"{PREFIX}-router"), "router")["env"]
    assert {"name": "PDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": f"{PREFIX}-api-key", "key": "api-key"}}} in env

    docs = render({"router": {"apiKey": {"existingSecret": "keys", "secretKey": "router"}}})
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [
        f"{PREFIX}-pod-tls"]
    env = container(find(docs, "Deployment", f"{PREFIX}-router"), "router")["env"]
    assert {"name": "PDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "keys", "key": "router"}}} in env
    assert "s3cret" not in str(docs)


def test_services_and_service_monitor() -> None:
    docs = render({"metrics": {"serviceMonitor": {"enabled": True,
                                                  "labels": {"release": "prom"}}}})
    prefill = find(docs, "Service", f"{PREFIX}-prefill")["spec"]
    decode = find(docs, "Service", f"{PREFIX}-decode")["spec"]
    router = find(docs, "Service", f"{PREFIX}-router")["spec"]
    assert prefill["clusterIP"] == decode["clusterIP"] == "None"
    assert [p["name"] for p in prefill["ports"]] == ["grpc", "metrics"]
    assert [(p["name"], p["port"]) for p in decode["ports"]] == [
        ("grpc", 50061), ("kv", 50062), ("metrics", 9102)]
    assert [(p["name"], p["port"]) for p in router["ports"]] == [("http", 8000), ("grpc", 50050)]
    monitor = find(docs, "ServiceMonitor", PREFIX)
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
        ("http", "/metrics"), ("metrics", "/metrics")]
    scrape = find(docs, "Deployment", f"{PREFIX}-decode")["spec"]["template"]["metadata"]
    assert scrape["annotations"]["prometheus.io/port"] == "9102"


@pytest.mark.parametrize("source", ["demo", "pvc", "hostPath"])
def test_model_volume_is_read_only(source: str) -> None:
    docs = render({"model": {"source": source, "dir": "llama",
                             "pvc": {"claimName": "weights"}, "hostPath": {"path": "/data/m"}}})
    for role in ("router", "prefill", "decode"):
        pod = find(docs, "Deployment", f"{PREFIX}-{role}")["spec"]["template"]["spec"]
        main = next(c for c in pod["containers"] if c["name"] == role)
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in main[
            "volumeMounts"]
        assert flag_values(main["args"])["--model"] == "/models/llama"
        volume = next(v for v in pod["volumes"] if v["name"] == "models")
        if source == "demo":
            assert volume == {"name": "models", "emptyDir": {}}
            (init,) = pod["initContainers"]
            assert init["args"] == ["make-model", "/models/llama",
                                    "--from-gguf=smollm2-135m-instruct"]
        else:
            assert "initContainers" not in pod
            assert volume == {
                "pvc": {"name": "models", "persistentVolumeClaim": {
                    "claimName": "weights", "readOnly": True}},
                "hostPath": {"name": "models", "hostPath": {
                    "path": "/data/m", "type": "Directory"}},
            }[source]


def test_pods_run_as_non_root() -> None:
    for deployment in (d for d in render(REDIS) if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_lint_reports_no_warnings() -> None:
    helm_python = importlib.import_module("helm_python")
    report = helm_python.lint(str(CHART_DIR))
    assert report["errors"] == []
    # Severity 1 is INFO (e.g. "icon is recommended"); 2+ are warnings/errors.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


FULL_VALUES: dict[str, Any] = {
    "redis": {"enabled": True},
    "prefill": {
        "autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": 50,
                        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}},
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "strategy": {"type": "RollingUpdate",
                     "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
    },
    "decode": {"autoscaling": {"enabled": True}, "kvTransport": "grpc"},
    "router": {"apiKey": {"value": "x"}, "extraEnv": [{"name": "LOG", "value": "1"}],
               "service": {"type": "LoadBalancer"}},
    "model": {"source": "hostPath", "hostPath": {"path": "/models"}},
    "tls": {"router": {"enabled": True, "secretName": "router-tls"},
            "pods": {"enabled": True, "secretName": "pod-tls"}},
    "podToken": {"value": "t0k"},
    "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]},
}


@pytest.mark.parametrize("values", [{}, FULL_VALUES], ids=["defaults", "everything-on"])
def test_objects_match_kubernetes_schemas(values: dict[str, Any]) -> None:
    kubernetes_validate = importlib.import_module("kubernetes_validate")
    docs = render(values)
    # ServiceMonitor is a CRD without a schema in the Kubernetes API.
    checked = [d for d in docs if d["kind"] != "ServiceMonitor"]
    for doc in checked:
        # strict: unknown fields (typos in a template) fail too.
        kubernetes_validate.validate(doc, "1.30", strict=True)
    assert len(checked) == (12 if not values else 18)


TLS = {"tls": {"router": {"enabled": True, "secretName": "router-tls"},
               "pods": {"enabled": True, "secretName": "pod-tls"}},
       "podToken": {"value": "t0k3n"}}


def _pod_spec(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return find(docs, "Deployment", f"{PREFIX}-{role}")["spec"]["template"]["spec"]


def test_tls_and_pod_token_mount_secrets_and_pass_flags() -> None:
    docs = render(TLS)
    pod_flags = {"--tls-cert-file": f"{POD_TLS_DIR}/tls.crt",
                 "--tls-key-file": f"{POD_TLS_DIR}/tls.key",
                 "--tls-ca-file": f"{POD_TLS_DIR}/ca.crt", "--tls-server-name": "pdserve-pod",
                 "--health-port": "50070",
                 "--pod-token-file": "/etc/pdserve/pod-token/pod-token"}
    for role in ("prefill", "decode"):
        flags = _args(docs, role)
        assert {k: flags.get(k) for k in pod_flags} == pod_flags
        assert "--no-tls-client-cert" not in flags
        main = container(find(docs, "Deployment", f"{PREFIX}-{role}"), role)
        # kubelet's gRPC probes cannot speak TLS: they go to the health-only port
        assert set(_probe_ports(main)) == {50070}
        assert {"name": "health", "containerPort": 50070, "protocol": "TCP"} in main["ports"]
    router = _args(docs, "router")
    assert {k: v for k, v in router.items() if "tls" in k or "-token-" in k} == {
        "--tls-cert-file": "/etc/pdserve/router-tls/tls.crt",
        "--tls-key-file": "/etc/pdserve/router-tls/tls.key",
        "--pod-tls-ca-file": f"{POD_TLS_DIR}/ca.crt",
        "--pod-tls-cert-file": f"{POD_TLS_DIR}/tls.crt",
        "--pod-tls-key-file": f"{POD_TLS_DIR}/tls.key",
        "--pod-tls-server-name": "pdserve-pod",
        "--pod-token-file": "/etc/pdserve/pod-token/pod-token",
    }
    main = container(find(docs, "Deployment", f"{PREFIX}-router"), "router")
    assert {main[p]["httpGet"]["scheme"] for p in ("livenessProbe", "readinessProbe")} == {
        "HTTPS"}
    # Secrets as volumes, mounted read-only where the flags point
    secret = find(docs, "Secret", f"{PREFIX}-pod-token")
    assert base64.b64decode(secret["data"]["pod-token"]) == b"t0k3n"
    expected = {"router": {"router-tls": "router-tls", "pod-tls": "pod-tls",
                           "pod-token": f"{PREFIX}-pod-token"},
                "prefill": {"pod-tls": "pod-tls", "pod-token": f"{PREFIX}-pod-token"},
                "decode": {"pod-tls": "pod-tls", "pod-token": f"{PREFIX}-pod-token"}}
    for role, secrets in expected.items():
        spec = _pod_spec(docs, role)
        assert {v["name"]: v["secret"]["secretName"] for v in spec["volumes"]
                if "secret" in v} == secrets
        mounts = container({"spec": {"template": {"spec": spec}}}, role)["volumeMounts"]
        assert {m["name"]: (m["mountPath"], m.get("readOnly")) for m in mounts
                if m["name"] in secrets} == {
            name: (f"/etc/pdserve/{name}", True) for name in secrets}
        annotations = find(docs, "Deployment", f"{PREFIX}-{role}")["spec"]["template"][
            "metadata"]["annotations"]
        assert "checksum/pod-token" in annotations
    assert _pod_spec(docs, "router") and "t0k3n" not in str(
        [d for d in docs if d["kind"] != "Secret"])
    assert find(docs, "Deployment", f"{PREFIX}-router")["spec"]["template"]["metadata"][
        "annotations"]["prometheus.io/scheme"] == "https"


def test_pod_token_instead_of_client_certificates() -> None:
    docs = render({"tls": {"pods": {"enabled": True, "secretName": "pod-tls",
                                    "clientAuth": False}},
                   "podToken": {"existingSecret": "tokens", "secretKey": "pods"}})
    for role in ("prefill", "decode"):
        flags = _args(docs, role)
        assert flags["--no-tls-client-cert"] == ""
        assert flags["--pod-token-file"] == "/etc/pdserve/pod-token/pods"
    router = _args(docs, "router")
    assert "--pod-tls-cert-file" not in router and "--pod-tls-key-file" not in router
    assert router["--pod-tls-ca-file"] == f"{POD_TLS_DIR}/ca.crt"
    assert [d for d in docs if d["kind"] == "Secret"] == []
    assert {v["name"]: v["secret"]["secretName"] for v in _pod_spec(docs, "router")["volumes"]
            if "secret" in v} == {"pod-tls": "pod-tls", "pod-token": "tokens"}


def _annotations(docs: list[dict[str, Any]], role: str) -> dict[str, str]:
    return find(docs, "Deployment", f"{PREFIX}-{role}")["spec"]["template"]["metadata"][
        "annotations"]


def _checksum(data: dict[str, str]) -> str:
    """Helm's `toJson | sha256sum` of a Secret's data (compact, keys sorted)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


def _write_pod_tls(secret: dict[str, Any], directory: Path) -> dict[str, str]:
    """The Secret's files as it mounts them; returns name -> path."""
    directory.mkdir()
    paths = {}
    for name, value in secret["data"].items():
        (directory / name).write_bytes(base64.b64decode(value))
        paths[name] = str(directory / name)
    return paths


def _health_check(address: str, tls: TlsFiles) -> grpc.StatusCode:
    with pod_channel(address, PodSecurity(tls=tls), aio=False) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


def test_default_pod_grpc_is_mutual_tls_with_a_generated_certificate(tmp_path) -> None:
    docs = render()
    secret = find(docs, "Secret", f"{PREFIX}-pod-tls")
    assert (secret["type"], sorted(secret["data"])) == (
        "kubernetes.io/tls", ["ca.crt", "tls.crt", "tls.key"])
    assert secret["metadata"]["annotations"] == {"pdserve.io/server-name": "pdserve-pod"}
    for role in ("router", "prefill", "decode"):
        assert {v["name"]: v["secret"]["secretName"] for v in _pod_spec(docs, role)["volumes"]
                if "secret" in v} == {"pod-tls": f"{PREFIX}-pod-tls"}
        # the Deployments saw the very bytes the Secret holds (one generation per render)
        annotations = _annotations(docs, role)
        assert annotations["checksum/pod-tls"] == _checksum(secret["data"])
        assert "checksum/pod-token" not in annotations
    for role in ("prefill", "decode"):
        assert "--no-tls-client-cert" not in _args(docs, role)

    # The files work as the pods and the router use them: a server with them
    # requires a client certificate its CA signed, for the name pdserve-pod.
    files = _write_pod_tls(secret, tmp_path / "pod-tls")
    other = _write_pod_tls(find(render(), "Secret", f"{PREFIX}-pod-tls"), tmp_path / "other")
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = add_port(server, "127.0.0.1:0", TlsFiles(
        cert_file=files["tls.crt"], key_file=files["tls.key"], ca_file=files["ca.crt"]))
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        router = TlsFiles(cert_file=files["tls.crt"], key_file=files["tls.key"],
                          ca_file=files["ca.crt"], server_name="pdserve-pod")
        assert _health_check(address, router) == grpc.StatusCode.OK
        stranger = TlsFiles(ca_file=files["ca.crt"], server_name="pdserve-pod")
        assert _health_check(address, stranger) == grpc.StatusCode.UNAVAILABLE
        # another install's certificate (another render) is not trusted
        other_install = TlsFiles(cert_file=other["tls.crt"], key_file=other["tls.key"],
                                 ca_file=files["ca.crt"], server_name="pdserve-pod")
        assert _health_check(address, other_install) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_pod_tls_without_client_certificates_gets_a_generated_pod_token() -> None:
    values = {"tls": {"pods": {"clientAuth": False}}}
    docs = render(values)
    secret = find(docs, "Secret", f"{PREFIX}-pod-token")
    token = base64.b64decode(secret["data"]["pod-token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token), token
    assert base64.b64decode(find(render(values), "Secret", f"{PREFIX}-pod-token")["data"][
        "pod-token"]).decode() != token  # random per install, never a value baked in
    for role in ("prefill", "decode"):
        flags = _args(docs, role)
        assert (flags["--no-tls-client-cert"], flags["--pod-token-file"]) == (
            "", "/etc/pdserve/pod-token/pod-token")
    router = _args(docs, "router")
    assert router["--pod-token-file"] == "/etc/pdserve/pod-token/pod-token"
    assert "--pod-tls-cert-file" not in router
    for role in ("router", "prefill", "decode"):
        assert {v["name"]: v["secret"]["secretName"] for v in _pod_spec(docs, role)["volumes"]
                if "secret" in v} == {"pod-tls": f"{PREFIX}-pod-tls",
                                      "pod-token": f"{PREFIX}-pod-token"}
        assert _annotations(docs, role)["checksum/pod-token"] == hashlib.sha256(
            secret["data"]["pod-token"].encode()).hexdigest()
    assert token not in str([d for d in docs if d["kind"] != "Secret"])
    # a token of the user's own replaces the generated one
    docs = render({"tls": {"pods": {"clientAuth": False}},
                   "podToken": {"existingSecret": "tokens"}})
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [
        f"{PREFIX}-pod-tls"]


def test_plaintext_pod_grpc_only_when_asked() -> None:
    docs = render({"tls": {"pods": {"enabled": False}}})
    assert [d for d in docs if d["kind"] == "Secret"] == []
    for role in ("prefill", "decode"):
        flags = _args(docs, role)
        assert not {k for k in flags if "tls" in k or "token" in k or k == "--health-port"}
        assert set(_probe_ports(container(find(docs, "Deployment", f"{PREFIX}-{role}"), role))
                   ) == {int(flags["--port"])}
    assert not {k for k in _args(docs, "router") if k.startswith("--pod-")}
    for role in ("router", "prefill", "decode"):
        assert not {k for k in _annotations(docs, role) if k.startswith("checksum/")}


def _ingress(docs: list[dict[str, Any]], component: str) -> list[tuple[int, Any]]:
    """(port, the components allowed in, or the raw `from`, None = anyone) per rule."""
    policy = find(docs, "NetworkPolicy", f"{PREFIX}-{component}")["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
    assert policy["policyTypes"] == ["Ingress"]
    rules = []
    for rule in policy["ingress"]:
        peers = rule.get("from")
        allowed = None if peers is None else [
            p["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
            if "podSelector" in p else p for p in peers]
        rules += [(port["port"], allowed) for port in rule["ports"]]
    return rules


def test_network_policies_fence_pod_grpc_and_the_kv_port() -> None:
    docs = render()
    assert _ingress(docs, "prefill") == [(50051, ["router"]), (9101, None)]
    assert _ingress(docs, "decode") == [(50061, ["router"]), (50062, ["prefill"]),
                                        (9102, None)]
    # same-release pods only: the selectors name this release
    rule = find(docs, "NetworkPolicy", f"{PREFIX}-decode")["spec"]["ingress"][1]
    assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == (
        "demo")
    monitoring = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    docs = render({**REDIS, "networkPolicy": {"metricsFrom": [monitoring]}})
    assert _ingress(docs, "decode")[2] == (9102, [monitoring])
    redis = find(docs, "NetworkPolicy", f"{PREFIX}-redis")["spec"]["ingress"]
    assert redis[0]["from"][0]["podSelector"]["matchExpressions"] == [{
        "key": "app.kubernetes.io/component", "operator": "In",
        "values": ["router", "prefill", "decode"]}]
    assert [d for d in render({"networkPolicy": {"enabled": False}})
            if d["kind"] == "NetworkPolicy"] == []


def test_service_monitor_scrapes_an_https_router() -> None:
    tls_config = {"ca": {"secret": {"name": "router-tls", "key": "ca.crt"}}}
    docs = render({**TLS, "metrics": {"serviceMonitor": {
        "enabled": True, "routerTlsConfig": tls_config}}})
    router, pods = find(docs, "ServiceMonitor", PREFIX)["spec"]["endpoints"]
    assert (router["port"], router["scheme"], router["tlsConfig"]) == (
        "http", "https", tls_config)
    assert "scheme" not in pods  # pod metrics stay plain HTTP
