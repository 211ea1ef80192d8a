"""`pod.server`: the ready file, the serve/drain loop and the start-up security warning."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest

from pod.drain import DrainGate, DrainState
from pod.server import is_loopback, security_warning, write_ready_file
from proto.tls import PodSecurity, TlsFiles


def test_ready_file_is_written_whole(tmp_path):
    path = tmp_path / "ready.json"
    write_ready_file(str(path), {"grpc": 1, "metrics": 2, "kv": 3})
    assert json.loads(path.read_text()) == {"grpc": 1, "metrics": 2, "kv": 3}
    assert not (tmp_path / "ready.json.tmp").exists()


@pytest.mark.timeout(60)
def test_pod_server_reports_not_serving_and_exits_1_when_it_can_no_longer_serve(tmp_path, caplog):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pod.config import ServerConfig
    from pod.server import PodServer

    ready = tmp_path / "ready.json"
    state = {"alive": True}

    async def scenario():
        pod = PodServer(role="prefill", model="m", config=ServerConfig(
            host="127.0.0.1", ready_file=str(ready), grace_period_s=1), gate=DrainGate(),
            server=PodServer.new_grpc_server(), services=("pdserve.v1.Prefill",),
            alive=lambda: state["alive"])
        task = asyncio.create_task(pod.run())
        while not ready.exists():
            await asyncio.sleep(0.01)
        port = json.loads(ready.read_text())["grpc"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Prefill"))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            state["alive"] = False  # e.g. the engine loop died
            return await asyncio.wait_for(task, 30), pod.gate.state

    with caplog.at_level(logging.INFO, logger="pod.server"):
        status, gate_state = asyncio.run(scenario())
    assert (status, gate_state) == (1, DrainState.STOPPED)
    ports = json.loads(ready.read_text())
    assert sorted(ports) == ["grpc", "kv"] and ports["kv"] == 0 and ports["grpc"] > 0
    # no TLS, no token: said with the port anyone could call; at INFO, since a
    # pod on loopback is reachable from this machine only (at WARNING elsewhere)
    said = [(r.levelno, r.getMessage()) for r in caplog.records
            if r.getMessage().startswith("prefill pod gRPC on ")]
    assert said == [(logging.INFO, security_warning("prefill", "127.0.0.1", ports["grpc"],
                                                    PodSecurity()))]


def test_only_a_loopback_address_is_reachable_from_this_machine_alone():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.5", "::", "pod-0.svc", ""))


TLS = TlsFiles(cert_file="tls.crt", key_file="tls.key")  # only paths: nothing is read here
MUTUAL = TlsFiles(cert_file="tls.crt", key_file="tls.key", ca_file="ca.crt")


def test_security_warning_names_what_authenticates_no_caller():
    assert security_warning("decode", "0.0.0.0", 50061, PodSecurity()) == (
        "decode pod gRPC on 0.0.0.0:50061 is plaintext and unauthenticated: anyone who can "
        "reach this port can call it. Serve it with --tls-cert-file, --tls-key-file and "
        "--tls-ca-file (mutual TLS), or TLS and --pod-token-file (docs/deploy.md, Security)")
    assert security_warning("prefill", "0.0.0.0", 50051, PodSecurity(tls=TLS)) == (
        "prefill pod gRPC on 0.0.0.0:50051 is encrypted but authenticates no caller: add "
        "--tls-ca-file (client certificates) or --pod-token-file (docs/deploy.md, Security)")
    no_client_cert = TlsFiles(cert_file="tls.crt", key_file="tls.key", ca_file="ca.crt",
                              require_client_cert=False)
    assert security_warning("prefill", "0.0.0.0", 1, PodSecurity(tls=no_client_cert)) == (
        "prefill pod gRPC on 0.0.0.0:1 is encrypted but authenticates no caller: add "
        "--tls-ca-file (client certificates) or --pod-token-file (docs/deploy.md, Security)")
    assert security_warning("prefill", "0.0.0.0", 1, PodSecurity(tls=TLS, token="t0k3n")) is None
    assert security_warning("decode", "0.0.0.0", 1, PodSecurity(tls=MUTUAL)) is None
