"""A TLS deployment of real processes on loopback (throwaway CA, tests/tls_certs.py):

    openai client --HTTPS--> router --mutual TLS + pod token--> prefill, decode
                                      prefill --mutual TLS + token--> decode's gRPC KV port

The router's HTTP and gRPC listeners serve TLS; the pods require client
certificates signed by the CA and the pod token. The module runs twice: the
KV over the gRPC connector, which uses the same channel helper, and over the
default TCP connector, whose streams use the same mutual TLS (KV TLS,
docs/kv_transfer.md). Strangers are refused (TLS handshake failure,
UNAUTHENTICATED) and the deployment keeps serving.
"""

from __future__ import annotations

import ssl

import grpc
import openai
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from proto.tls import PodSecurity, TlsFiles, pod_channel
from tests.integration.pods import start_pods
from tests.router.router_process import start_router, wait_ready
from tests.tls_certs import SERVER_NAME, make_certs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module", params=["grpc", "tcp"])
def deployment(request, tiny_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    certs = make_certs(directory / "certs")
    token_file = directory / "pod-token"
    token_file.write_text("pod-s3cret\n")  # as a Secret mounts it: trailing newline
    pod_flags = {"tls_cert_file": certs.pod_cert, "tls_key_file": certs.pod_key,
                 "tls_ca_file": certs.ca, "tls_server_name": SERVER_NAME,
                 "pod_token_file": str(token_file), "health_port": 0}
    pods = start_pods({"prefill": ("prefill", pod_flags),
                       "decode": ("decode", {**pod_flags, "kv_transport": request.param})},
                      tiny_model_dir)
    router = None
    try:
        router = start_router(
            tiny_model_dir, prefill=[pods["prefill"].address], decode=[pods["decode"].address],
            tls_cert_file=certs.pod_cert, tls_key_file=certs.pod_key,
            pod_tls_ca_file=certs.ca, pod_tls_cert_file=certs.client_cert,
            pod_tls_key_file=certs.client_key, pod_tls_server_name=SERVER_NAME,
            pod_token_file=str(token_file))
        wait_ready(router, context=ssl.create_default_context(cafile=certs.ca))
        yield {"certs": certs, "router": router, "kv_transport": request.param, **pods}
    finally:
        if router is not None:
            router.terminate()
        for pod in pods.values():
            pod.kill()


def _openai(deployment, *, trust: bool = True) -> openai.OpenAI:
    # without `trust`: the system roots only, which never signed the test CA
    verify = ssl.create_default_context(cafile=deployment["certs"].ca if trust else None)
    return openai.OpenAI(base_url=deployment["router"].base_url, api_key="unused",
                         max_retries=0, timeout=120,
                         http_client=openai.DefaultHttpxClient(verify=verify))


def _complete(deployment) -> str:
    completion = _openai(deployment).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 12
    return completion.choices[0].text


def test_openai_client_over_https_streams_what_it_gets_whole(deployment):
    assert deployment["router"].base_url.startswith("https://")
    whole = _complete(deployment)
    chunks = _openai(deployment).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    # a client that does not trust the test CA refuses the router's certificate
    with pytest.raises(openai.APIConnectionError):
        _openai(deployment, trust=False).models.list()


def test_grpc_client_over_tls_gets_the_http_answer(deployment):
    router = deployment["router"]
    credentials = grpc.ssl_channel_credentials(
        root_certificates=open(deployment["certs"].ca, "rb").read())
    request = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True))
    with grpc.secure_channel(router.grpc_address, credentials) as channel:
        messages = list(pdserve_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))
    assert messages[-1].finish_reason == "length"
    assert "".join(m.text for m in messages) == _complete(deployment)
    with grpc.insecure_channel(router.grpc_address) as channel, \
            pytest.raises(grpc.RpcError) as refused:
        list(pdserve_pb2_grpc.RouterStub(channel).Generate(request, timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS: no handshake


def _refusal(address: str, security: PodSecurity, call) -> grpc.StatusCode:
    with pod_channel(address, security, aio=False) as channel:
        try:
            call(channel)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_pods_refuse_callers_without_certificate_or_token_and_keep_serving(deployment):
    certs = deployment["certs"]
    stranger = PodSecurity(tls=TlsFiles(ca_file=certs.ca, server_name=SERVER_NAME))
    wrong_token = PodSecurity(tls=TlsFiles(certs.client_cert, certs.client_key, certs.ca,
                                           server_name=SERVER_NAME), token="guess")

    def get_load(channel):
        pdserve_pb2_grpc.DecodeStub(channel).GetLoad(pb.LoadRequest(), timeout=10)

    def push(channel):  # the decode pod's gRPC KV port
        pdserve_pb2_grpc.KVTransferStub(channel).Push(iter(()), timeout=10)

    decode, prefill = deployment["decode"], deployment["prefill"]
    ports = [(decode.address, get_load), (prefill.address, get_load)]
    if deployment["kv_transport"] == "grpc":
        ports.append((f"127.0.0.1:{decode.kv_port}", push))
    else:  # the TCP KV port follows pod TLS, and the pod says so
        assert "(KV TLS; --no-kv-tls turns it off)" in decode.log_tail(10**6)
    codes = [_refusal(address, security, call) for address, call in ports
             for security in (stranger, wrong_token, PodSecurity())]
    unavailable, unauthenticated = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED
    assert codes == [unavailable, unauthenticated, unavailable] * len(ports)
    # the deployment still serves, and its answer did not change
    assert _complete(deployment) == _complete(deployment)
    assert decode.alive() and prefill.alive()
