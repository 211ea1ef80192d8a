"""KV TLS in the chart: the TCP KV streams follow the pods' TLS (on by
default wherever `tls.pods.enabled` is), and `tls.pods.kvStreams: false`
passes --no-kv-tls to prefill and decode pods alike (both ends must agree)."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from tests.helm.chart import PREFIX, RenderError, container, find, flag_values, render

pytestmark = pytest.mark.timeout(60)
ROLES = ("prefill", "decode")


def _flags(docs, role: str) -> dict[str, str]:
    return flag_values(container(find(docs, "Deployment", f"{PREFIX}-{role}"), role)["args"])


def test_kv_tls_is_on_wherever_pod_tls_is_by_default() -> None:
    docs = render()
    for role in ROLES:
        flags = _flags(docs, role)
        assert flags["--tls-cert-file"] == "/etc/pdserve/pod-tls/tls.crt"
        assert "--no-kv-tls" not in flags  # the pods' rule: KV TLS follows --tls-cert-file


def test_kv_streams_false_turns_kv_tls_off_on_both_ends_only() -> None:
    docs = render({"tls": {"pods": {"kvStreams": False}}})
    for role in ROLES:
        flags = _flags(docs, role)
        assert flags["--no-kv-tls"] == ""
        assert flags["--tls-ca-file"] == "/etc/pdserve/pod-tls/ca.crt"  # pod gRPC keeps TLS
    assert "--no-kv-tls" not in str(find(docs, "Deployment", f"{PREFIX}-router"))
    # what the chart passes is what the pods parse: KV TLS off, pod TLS on
    args = build_parser(["decode"]).parse_args(
        ["decode", "--model", "m", "--tls-cert-file", "c", "--tls-key-file", "k",
         "--no-kv-tls"])
    assert args.kv_tls is False


def test_without_pod_tls_there_is_nothing_to_turn_off() -> None:
    docs = render({"tls": {"pods": {"enabled": False, "kvStreams": False}}})
    for role in ROLES:
        flags = _flags(docs, role)
        assert "--no-kv-tls" not in flags and "--tls-cert-file" not in flags


def test_kv_streams_must_be_a_boolean() -> None:
    with pytest.raises(RenderError, match="kvStreams"):
        render({"tls": {"pods": {"kvStreams": "no"}}})
