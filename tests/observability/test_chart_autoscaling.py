"""The chart's Grafana dashboard and token-signal autoscaling (issue 39):
they render and validate against the Kubernetes schemas, and every pdserve
metric the dashboard, the HPAs and the prometheus-adapter rules query exists
on a live router, prefill pod and decode pod (real processes on loopback,
the tiny model), whose pages docs/observability.md's table must match."""

from __future__ import annotations

import importlib
import json
from typing import Any

import openai
import pytest
import yaml

from tests.helm.chart import CHART_DIR, PREFIX, RenderError, find, render
from tests.integration.pods import start_pods
from tests.observability.names import (
    exposed_families,
    names_in,
    scrape,
    series_names,
    table_rows,
)
from tests.router.router_process import start_router, wait_ready

ON: dict[str, Any] = {
    "redis": {"enabled": True},
    "dashboard": {"enabled": True, "annotations": {"grafana_folder": "pdserve"}},
    "prefill": {"autoscaling": {"enabled": True, "tokenSignals": {"enabled": True}}},
    "decode": {"autoscaling": {"enabled": True, "tokenSignals": {"enabled": True}}},
}
POD = {"block_size": 16, "num_blocks": 128}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(ON)


def _dashboard(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = find(docs, "ConfigMap", f"{PREFIX}-dashboard")
    return json.loads(cm["data"]["pdserve.json"])


def _adapter_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = find(docs, "ConfigMap", f"{PREFIX}-autoscaling-adapter-rules")
    return yaml.safe_load(cm["data"]["config.yaml"])


def _hpa_metric_names(docs: list[dict[str, Any]]) -> set[str]:
    names = set()
    for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            source = metric.get("pods") or metric.get("external") or metric.get("object")
            if source is not None:
                names.add(source["metric"]["name"])
    return names


def queried_names(docs: list[dict[str, Any]]) -> set[str]:
    """Every pdserve_* name the dashboard, the HPAs and the adapter rules use."""
    dashboard = _dashboard(docs)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    names = set().union(*(names_in(e) for e in exprs))
    rules = _adapter_config(docs)
    for rule in rules["rules"] + rules.get("externalRules", []):
        names |= names_in(rule["seriesQuery"])
    return names | _hpa_metric_names(docs)


def test_everything_on_validates_against_the_kubernetes_schemas(docs) -> None:
    kubernetes_validate = importlib.import_module("kubernetes_validate")
    checked = [d for d in docs if d["kind"] != "ServiceMonitor"]
    for doc in checked:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in checked}
    assert {("ConfigMap", f"{PREFIX}-dashboard"),
            ("ConfigMap", f"{PREFIX}-autoscaling-adapter-rules"),
            ("HorizontalPodAutoscaler", f"{PREFIX}-prefill"),
            ("HorizontalPodAutoscaler", f"{PREFIX}-decode")} <= kinds


def test_dashboard_configmap_is_the_repo_json_for_the_sidecar(docs) -> None:
    cm = find(docs, "ConfigMap", f"{PREFIX}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "pdserve"}
    dashboard = _dashboard(docs)
    assert dashboard == json.loads((CHART_DIR / "dashboards" / "pdserve.json").read_text())
    # the datasource is a template variable every panel uses
    assert dashboard["templating"]["list"][0]["type"] == "datasource"
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {"${datasource}"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_token_signal_hpas_and_their_adapter_rules(docs) -> None:
    targets = {}
    for role in ("prefill", "decode"):
        hpa = find(docs, "HorizontalPodAutoscaler", f"{PREFIX}-{role}")
        for m in hpa["spec"]["metrics"]:
            source = m.get("pods") or m["external"]
            targets[role, m["type"], source["metric"]["name"]] = source["target"]["averageValue"]
    assert targets == {
        ("prefill", "Pods", "pdserve_prompt_tokens_waiting"): "8192",
        ("prefill", "External", "pdserve_router_queue_tokens"): "8192",
        ("decode", "Pods", "pdserve_kv_cache_usage_ratio"): "0.8",
        ("decode", "Pods", "pdserve_requests_running"): "32",
    }
    rules = _adapter_config(docs)
    served = {r["name"]["as"] for r in rules["rules"]}
    assert served == {"pdserve_prompt_tokens_waiting", "pdserve_kv_cache_usage_ratio",
                      "pdserve_requests_running"}
    assert [r["name"]["as"] for r in rules["externalRules"]] == ["pdserve_router_queue_tokens"]
    for rule in rules["rules"]:
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_off_by_default_and_decode_only_rules() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render({})}
    assert not {k for k in kinds if k[0] in ("ConfigMap", "HorizontalPodAutoscaler")}
    docs = render({"redis": {"enabled": True}, "decode": ON["decode"]})
    rules = _adapter_config(docs)
    assert "externalRules" not in rules
    assert {r["name"]["as"] for r in rules["rules"]} == {
        "pdserve_kv_cache_usage_ratio", "pdserve_requests_running"}


def test_token_signals_need_their_thresholds() -> None:
    with pytest.raises(RenderError, match="kvCacheUsage"):
        render({"redis": {"enabled": True}, "decode": {"autoscaling": {
            "enabled": True, "tokenSignals": {"enabled": True, "kvCacheUsage": ""}}}})
    with pytest.raises(RenderError, match="kvCacheUsage"):
        render({"redis": {"enabled": True}, "decode": {"autoscaling": {
            "enabled": True, "tokenSignals": {"enabled": True, "kvCacheUsage": "1.5"}}}})


@pytest.fixture(scope="module")
def pages(tiny_model_dir) -> dict[str, str]:
    """/metrics of a router, a prefill pod and a decode pod after one
    disaggregated request."""
    pods = start_pods({"prefill": ("prefill", POD), "decode": ("decode", POD)}, tiny_model_dir)
    router = None
    try:
        router = start_router(tiny_model_dir, prefill=[pods["prefill"].address],
                              decode=[pods["decode"].address],
                              local_prefill_max_tokens=0, split_prefill_min_tokens=0)
        wait_ready(router)
        client = openai.OpenAI(base_url=router.base_url, api_key="-", max_retries=0, timeout=60)
        done = client.completions.create(model="tiny", prompt="The tide counts the stones",
                                         max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text
        yield {"router": scrape(router.url("/metrics")),
               "prefill": scrape(pods["prefill"].metrics_url),
               "decode": scrape(pods["decode"].metrics_url)}
    finally:
        if router is not None:
            router.terminate()
        for pod in pods.values():
            pod.kill()


@pytest.mark.timeout(300)
def test_every_queried_metric_exists_on_live_pods(docs, pages) -> None:
    live = set().union(*(series_names(exposed_families(p)) for p in pages.values()))
    queried = queried_names(docs)
    assert len(queried) > 20
    assert sorted(queried - live) == []


@pytest.mark.timeout(300)
def test_the_metric_table_matches_the_live_pages(pages) -> None:
    families: dict[str, str] = {}
    for page in pages.values():
        families |= exposed_families(page)
    rows = table_rows()
    assert sorted(set(families) - set(rows)) == [], "registered but not in the table"
    assert sorted(set(rows) - set(families)) == [], "in the table but on no live page"
    kinds = {name: kind for name, kind in rows.items() if families[name] != kind}
    assert kinds == {}, "table type differs from the exposed type"
