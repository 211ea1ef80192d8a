"""pdserve/commands/_security_flags.py: the TLS and pod-token flags of pods and
the router become `TlsFiles` / `PodSecurity`, and the router's
`RouterConfig`; the token comes from a file, the flag or $PDSERVE_POD_TOKEN."""

from __future__ import annotations

import argparse

import pytest

from pdserve.commands import _pod_flags, _security_flags
from pdserve.commands import router as router_command
from proto.tls import PodSecurity, TlsFiles


def _pod(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _pod_flags.add_server_arguments(parser, port=1, metrics_port=2)
    return parser.parse_args(argv)


def _router(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router_command.add_arguments(parser)
    return parser.parse_args(["--model", "/m", *argv])


def test_pods_default_to_plaintext_without_authentication(monkeypatch):
    monkeypatch.delenv("PDSERVE_POD_TOKEN", raising=False)
    config = _pod_flags.server_config_from_args(_pod([]))
    assert config.security == PodSecurity() and config.health_port is None


def test_pod_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_POD_TOKEN", raising=False)
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    config = _pod_flags.server_config_from_args(_pod([
        "--tls-cert-file", "c.pem", "--tls-key-file", "k.pem", "--tls-ca-file", "ca.pem",
        "--tls-server-name", "pdserve-pod", "--pod-token-file", str(token),
        "--health-port", "0"]))
    assert config.security == PodSecurity(
        tls=TlsFiles("c.pem", "k.pem", "ca.pem", server_name="pdserve-pod"), token="s3cret")
    assert config.security.tls.mutual and config.health_port == 0
    config = _pod_flags.server_config_from_args(_pod([
        "--tls-cert-file", "c.pem", "--tls-key-file", "k.pem", "--tls-ca-file", "ca.pem",
        "--no-tls-client-cert", "--pod-token", "t"]))
    assert not config.security.tls.mutual and config.security.token == "t"
    monkeypatch.setenv("PDSERVE_POD_TOKEN", "from-env")
    config = _pod_flags.server_config_from_args(_pod([
        "--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"]))
    assert config.security.token == "from-env" and config.security.describe() == "TLS + token"


@pytest.mark.parametrize(("argv", "message"), [
    (["--tls-ca-file", "ca.pem"], "--tls-ca-file needs --tls-cert-file"),
    (["--tls-cert-file", "c.pem"], "certificate file and its key file go together"),
    (["--pod-token", "t"], "a pod token needs TLS"),
    (["--health-port", "70000"], "health_port must be in"),
])
def test_bad_pod_flags_are_refused(argv, message, monkeypatch):
    monkeypatch.delenv("PDSERVE_POD_TOKEN", raising=False)
    with pytest.raises(ValueError, match=message):
        _pod_flags.server_config_from_args(_pod(argv))


def test_empty_token_file_is_refused(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        _pod_flags.server_config_from_args(_pod([
            "--tls-cert-file", "c", "--tls-key-file", "k", "--pod-token-file", str(empty)]))


def test_router_flags(monkeypatch):
    monkeypatch.delenv("PDSERVE_POD_TOKEN", raising=False)
    config = router_command.config_from_args(_router([
        "--colocated", "a:1", "--tls-cert-file", "r.pem", "--tls-key-file", "r.key",
        "--pod-tls-ca-file", "ca.pem", "--pod-tls-cert-file", "c.pem",
        "--pod-tls-key-file", "c.key", "--pod-tls-server-name", "pdserve-pod",
        "--pod-token", "t"]))
    assert config.tls == TlsFiles("r.pem", "r.key")
    assert config.pod_security == PodSecurity(
        tls=TlsFiles("c.pem", "c.key", "ca.pem", server_name="pdserve-pod"), token="t")
    plain = router_command.config_from_args(_router(["--colocated", "a:1"]))
    assert plain.tls is None and plain.pod_security == PodSecurity()


@pytest.mark.parametrize(("argv", "message"), [
    (["--tls-ca-file", "ca.pem"], "tls needs a certificate and key file"),
    (["--pod-tls-server-name", "x"], "--pod-tls-server-name needs --pod-tls-ca-file"),
    (["--pod-token", "t"], "a pod token needs TLS"),
])
def test_bad_router_flags_are_refused(argv, message, monkeypatch):
    monkeypatch.delenv("PDSERVE_POD_TOKEN", raising=False)
    with pytest.raises(ValueError, match=message):
        router_command.config_from_args(_router(["--colocated", "a:1", *argv]))


def test_token_sources_are_exclusive():
    parser = argparse.ArgumentParser()
    _security_flags.add_pod_security_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--pod-token", "a", "--pod-token-file", "f"])
