"""`proto.tls`: TLS from PEM files, the pod token, and the channel helper,
against real gRPC servers on loopback with throwaway certificates
(tests/tls_certs.py). The pod server is the real `PodServer`."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pod.config import ServerConfig
from pod.drain import DrainGate
from pod.server import PodServer
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from proto.tls import PodSecurity, TlsFiles, add_port, pod_channel, server_interceptors
from tests.tls_certs import SERVER_NAME, make_certs

pytestmark = pytest.mark.timeout(60)
TOKEN = "t0k3n-abc"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


class _LoadOnly(pdserve_pb2_grpc.PrefillServicer):
    async def GetLoad(self, request, context):
        return pb.LoadReport(role="prefill", num_running=7)


def test_files_and_token_are_validated(certs, tmp_path):
    with pytest.raises(ValueError, match="certificate file and its key file go together"):
        TlsFiles(cert_file=certs.pod_cert)
    with pytest.raises(ValueError, match="needs TLS on pod gRPC"):
        PodSecurity(token=TOKEN)
    with pytest.raises(ValueError, match="free of whitespace"):
        PodSecurity(tls=TlsFiles(ca_file=certs.ca), token="two words")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="is not a PEM file"):
        TlsFiles(cert_file=str(not_pem), key_file=certs.pod_key).server_credentials()
    with pytest.raises(ValueError, match="cannot be read"):
        TlsFiles(cert_file=certs.pod_cert, key_file=str(tmp_path / "absent")).ssl_context()
    with pytest.raises(ValueError, match="needs a certificate and key file"):
        TlsFiles(ca_file=certs.ca).server_credentials()
    assert TOKEN not in repr(PodSecurity(tls=TlsFiles(ca_file=certs.ca), token=TOKEN))


def _client(certs, *, cert=True, token=TOKEN, rogue=False) -> PodSecurity:
    if rogue:
        files = TlsFiles(certs.rogue_cert, certs.rogue_key, certs.ca, server_name=SERVER_NAME)
    elif cert:
        files = TlsFiles(certs.client_cert, certs.client_key, certs.ca, server_name=SERVER_NAME)
    else:
        files = TlsFiles(ca_file=certs.ca, server_name=SERVER_NAME)
    return PodSecurity(tls=files, token=token)


async def _get_load(address: str, security: PodSecurity) -> grpc.StatusCode:
    async with pod_channel(address, security) as channel:
        try:
            reply = await pdserve_pb2_grpc.PrefillStub(channel).GetLoad(pb.LoadRequest(),
                                                                        timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    assert reply.num_running == 7
    return grpc.StatusCode.OK


async def _health(address: str, security: PodSecurity) -> int:
    async with pod_channel(address, security) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10)
    return reply.status


def test_pod_server_with_mutual_tls_and_token_refuses_strangers_and_keeps_serving(
        certs, tmp_path):
    security = PodSecurity(tls=TlsFiles(certs.pod_cert, certs.pod_key, certs.ca), token=TOKEN)
    ready = tmp_path / "ready.json"
    stop = asyncio.Event()

    async def scenario():
        server = PodServer.new_grpc_server(security)
        pdserve_pb2_grpc.add_PrefillServicer_to_server(_LoadOnly(), server)
        pod = PodServer(role="prefill", model="m", gate=DrainGate(), server=server,
                        services=("pdserve.v1.Prefill",),
                        config=ServerConfig(host="127.0.0.1", ready_file=str(ready),
                                            grace_period_s=1, security=security,
                                            health_port=0))
        task = asyncio.create_task(pod.run(stop))
        while not ready.exists():
            await asyncio.sleep(0.01)
        ports = json.loads(ready.read_text())
        address = f"127.0.0.1:{ports['grpc']}"
        codes = {
            "router": await _get_load(address, _client(certs)),
            "wrong token": await _get_load(address, _client(certs, token="nope")),
            "no token": await _get_load(address, _client(certs, token=None)),
            "no client cert": await _get_load(address, _client(certs, cert=False)),
            "rogue CA": await _get_load(address, _client(certs, rogue=True)),
            "plaintext": await _get_load(address, PodSecurity()),
            "router again": await _get_load(address, _client(certs)),
        }
        # Health: open to certified callers without the token, and on the
        # plaintext health port to anyone (kubelet).
        statuses = (await _health(address, _client(certs, token=None)),
                    await _health(f"127.0.0.1:{ports['health']}", PodSecurity()))
        stop.set()
        return codes, statuses, await asyncio.wait_for(task, 30)

    codes, statuses, exit_status = asyncio.run(scenario())
    ok, unauthenticated, unavailable = (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED,
                                        grpc.StatusCode.UNAVAILABLE)
    assert codes == {"router": ok, "wrong token": unauthenticated,
                     "no token": unauthenticated, "no client cert": unavailable,
                     "rogue CA": unavailable, "plaintext": unavailable, "router again": ok}
    assert statuses == (health_pb2.HealthCheckResponse.SERVING,) * 2
    assert exit_status == 0


def test_token_over_server_tls_without_client_certificates(certs):
    """--no-tls-client-cert: TLS authenticates the pod, the token the caller."""
    security = PodSecurity(tls=TlsFiles(certs.pod_cert, certs.pod_key, certs.ca,
                                        require_client_cert=False), token=TOKEN)

    async def scenario():
        server = grpc.aio.server(interceptors=server_interceptors(security))
        pdserve_pb2_grpc.add_PrefillServicer_to_server(_LoadOnly(), server)
        address = f"127.0.0.1:{add_port(server, '127.0.0.1:0', security.tls)}"
        await server.start()
        try:
            return (await _get_load(address, _client(certs, cert=False)),
                    await _get_load(address, _client(certs, cert=False, token="x")))
        finally:
            await server.stop(None)

    assert asyncio.run(scenario()) == (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED)


def test_synchronous_server_and_channel(certs):
    """The gRPC KV port's flavour: a threaded server, a blocking channel."""
    security = PodSecurity(tls=TlsFiles(certs.pod_cert, certs.pod_key, certs.ca), token=TOKEN)

    class LoadOnly(pdserve_pb2_grpc.PrefillServicer):
        def GetLoad(self, request, context):
            return pb.LoadReport(role="prefill", num_running=7)

    server = grpc.server(ThreadPoolExecutor(2),
                         interceptors=server_interceptors(security, aio=False))
    pdserve_pb2_grpc.add_PrefillServicer_to_server(LoadOnly(), server)
    address = f"127.0.0.1:{add_port(server, '127.0.0.1:0', security.tls)}"
    server.start()
    try:
        def call(client: PodSecurity) -> grpc.StatusCode:
            with pod_channel(address, client, aio=False) as channel:
                try:
                    pdserve_pb2_grpc.PrefillStub(channel).GetLoad(pb.LoadRequest(), timeout=10)
                except grpc.RpcError as exc:
                    return exc.code()
            return grpc.StatusCode.OK

        assert call(_client(certs)) == grpc.StatusCode.OK
        assert call(_client(certs, token="bad")) == grpc.StatusCode.UNAUTHENTICATED
        assert call(_client(certs, cert=False)) == grpc.StatusCode.UNAVAILABLE
        assert call(_client(certs)) == grpc.StatusCode.OK
    finally:
        server.stop(None).wait(10)


def test_https_context_requires_client_certificates_with_a_ca(certs):
    """The router's HTTPS listener with --tls-ca-file: a client without a
    certificate is refused, one with a certificate the CA signed is served,
    and the listener keeps accepting."""
    import socket
    import ssl
    import threading

    server_context = TlsFiles(certs.pod_cert, certs.pod_key, certs.ca).ssl_context()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    outcomes: list[str] = []

    def serve(connections: int) -> None:
        for _ in range(connections):
            sock, _ = listener.accept()
            try:
                with server_context.wrap_socket(sock, server_side=True) as tls:
                    tls.sendall(b"hello " + tls.recv(5))
                    outcomes.append("served")
            except (ssl.SSLError, OSError) as exc:
                outcomes.append(type(exc).__name__)

    def client(with_cert: bool) -> bytes | None:
        context = ssl.create_default_context(cafile=certs.ca)
        if with_cert:
            context.load_cert_chain(certs.client_cert, certs.client_key)
        with socket.create_connection(listener.getsockname(), timeout=10) as sock, \
                context.wrap_socket(sock, server_hostname="localhost") as tls:
            try:
                tls.sendall(b"there")
                return tls.recv(64)
            except (ssl.SSLError, OSError):
                return None  # TLS 1.3: the refusal arrives with the first read

    thread = threading.Thread(target=serve, args=(3,), daemon=True)
    thread.start()
    try:
        assert client(with_cert=False) is None
        assert client(with_cert=True) == b"hello there"
        assert client(with_cert=True) == b"hello there"
    finally:
        thread.join(10)
        listener.close()
    assert outcomes[0] != "served" and outcomes[1:] == ["served", "served"]
