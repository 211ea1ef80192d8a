"""The chart's per-role `tensorParallelSize`: the flag, one GPU per rank,
a memory-backed /dev/shm, and a decode pod's per-rank KV ports (rank r on
kvPort + r) declared and let through its NetworkPolicy."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from tests.helm.chart import PREFIX, RenderError, container, find, flag_values, render

pytestmark = pytest.mark.timeout(60)

TP = {"prefill": {"tensorParallelSize": 2, "gpu": True},
      "decode": {"tensorParallelSize": 4, "gpu": True, "shmSize": "8Gi"}}


def _pod(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return find(docs, "Deployment", f"{PREFIX}-{role}")["spec"]["template"]["spec"]


def _main(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return container(find(docs, "Deployment", f"{PREFIX}-{role}"), role)


def test_default_pods_run_one_rank_without_gpus_or_shm() -> None:
    docs = render()
    for role in ("prefill", "decode"):
        main = _main(docs, role)
        assert flag_values(main["args"])["--tensor-parallel-size"] == "1"
        assert "nvidia.com/gpu" not in str(main["resources"])
        assert "dshm" not in str(_pod(docs, role))
    ports = [p["name"] for p in _main(docs, "decode")["ports"]]
    assert ports == ["grpc", "kv", "metrics", "health"]  # health: pod TLS is on by default


def test_each_rank_gets_a_gpu_and_the_pod_a_memory_backed_shm() -> None:
    docs = render(TP)
    for role, ranks, shm in (("prefill", 2, "2Gi"), ("decode", 4, "8Gi")):
        main = _main(docs, role)
        assert flag_values(main["args"])["--tensor-parallel-size"] == str(ranks)
        # extended resources: requests must equal limits
        assert main["resources"]["limits"]["nvidia.com/gpu"] == ranks
        assert main["resources"]["requests"]["nvidia.com/gpu"] == ranks
        assert main["resources"]["limits"]["memory"] == "8Gi"  # the role's own stay
        volumes = {v["name"]: v for v in _pod(docs, role)["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}
        mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
        assert mounts["dshm"] == "/dev/shm"


def test_a_decode_pod_declares_and_admits_every_ranks_kv_port() -> None:
    docs = render(TP)
    ports = {p["name"]: p["containerPort"] for p in _main(docs, "decode")["ports"]}
    assert {name: ports[name] for name in ("kv", "kv-1", "kv-2", "kv-3")} == {
        "kv": 50062, "kv-1": 50063, "kv-2": 50064, "kv-3": 50065}
    policy = find(docs, "NetworkPolicy", f"{PREFIX}-decode")["spec"]["ingress"]
    kv_rule = [r for r in policy if any(p["port"] == 50062 for p in r["ports"])]
    assert kv_rule[0]["ports"] == [{"port": 50062, "endPort": 50065, "protocol": "TCP"}]
    assert kv_rule[0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "prefill"


def test_tensor_parallel_objects_match_kubernetes_schemas() -> None:
    kubernetes_validate = importlib.import_module("kubernetes_validate")
    for doc in render(TP):
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, "1.30", strict=True)


@pytest.mark.parametrize("values", [
    {"decode": {"tensorParallelSize": 3}},
    {"prefill": {"tensorParallelSize": 0}},
    {"prefill": {"shmSize": "2GiB"}},
    {"decode": {"gpu": "yes"}},
], ids=["not-a-power-of-two", "zero", "not-a-quantity", "gpu-not-bool"])
def test_render_refuses_bad_tensor_parallel_values(values: dict[str, Any]) -> None:
    with pytest.raises(RenderError, match="tensorParallelSize|shmSize|gpu"):
        render(values)
