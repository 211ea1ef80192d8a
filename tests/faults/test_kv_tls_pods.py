"""KV TLS between real pods (the router, prefill and decode processes, the
openai client; throwaway CA from tests/tls_certs.py): both pods serve gRPC
over mutual TLS, so their TCP KV streams do too (the rule: KV TLS follows pod
TLS), and a stream through them is token-identical to a plaintext pod's.
Mismatched ends and bad certificates are refused on loopback
(tests/kv_transfer/tcp/test_tcp_tls.py)."""

from __future__ import annotations

import openai
import pytest

from tests.integration.pods import start_pods
from tests.router.router_process import start_router, wait_ready
from tests.tls_certs import SERVER_NAME, make_certs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT = "A lighthouse keeper counts the ships that pass"
POD = {"block_size": 16, "num_blocks": 256}


def _stream(router) -> str:
    client = openai.OpenAI(base_url=router.base_url, api_key="-", max_retries=0, timeout=60)
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_a_stream_over_kv_tls_is_token_identical_to_a_plaintext_pods(tiny_model_dir,
                                                                      tmp_path):
    certs = make_certs(tmp_path / "certs")
    tls = {"tls_cert_file": certs.pod_cert, "tls_key_file": certs.pod_key,
           "tls_ca_file": certs.ca, "tls_server_name": SERVER_NAME, "health_port": 0}
    pods = start_pods({"prefill": ("prefill", {**POD, **tls}),
                       "decode": ("decode", {**POD, **tls}),
                       "reference": ("colocated", POD)}, tiny_model_dir)
    routers = []
    try:
        routers.append(reference := start_router(
            tiny_model_dir, colocated=[pods["reference"].address]))
        routers.append(router := start_router(
            tiny_model_dir, prefill=[pods["prefill"].address], decode=[pods["decode"].address],
            pod_tls_ca_file=certs.ca, pod_tls_cert_file=certs.client_cert,
            pod_tls_key_file=certs.client_key, pod_tls_server_name=SERVER_NAME,
            split_prefill_min_tokens=0, local_prefill_max_tokens=0))
        wait_ready(reference)
        wait_ready(router)
        expected = _stream(reference)
        assert expected
        assert _stream(router) == expected
        decode = pods["decode"]
        assert "(KV TLS; --no-kv-tls turns it off)" in decode.log_tail(10**6)
        assert decode.metric_value("pdserve_kv_transfer_bytes_total", role="decode") > 0
        # nothing refused: the prefill pod's streams got in at the first handshake
        assert "pdserve_kv_port_refusals_total{" not in decode.metrics_text()
    finally:
        for r in routers:
            r.terminate()
        for pod in pods.values():
            pod.kill()
