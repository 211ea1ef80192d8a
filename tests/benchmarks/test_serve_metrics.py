"""The pod counters `pdserve bench serve` reads around its load settle on
both sides: a transfer whose verdict reaches the prefill pod after its
client is done counts in neither the warm-up nor the run twice.

A real HTTP server on loopback stands in for a prefill pod's /metrics; its
`pdserve_kv_transfer_bytes_total` moves once, just after it is first read
(the warm-up's late verdict)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks import serve, serve_metrics
from benchmarks.serve_client import LoadSpec
from benchmarks.serve_workload import BenchRequest, Session

LATE_BYTES = 8192


class _LateCounter:
    """/metrics text whose prefill byte counter is `base` on the first read
    and `base + LATE_BYTES` from the second on."""

    def __init__(self, base: float) -> None:
        self.base = base
        self.reads = 0
        self.lock = threading.Lock()

    def text(self) -> bytes:
        with self.lock:
            value = self.base + (LATE_BYTES if self.reads else 0)
            self.reads += 1
        return (
            "# TYPE pdserve_kv_transfer_bytes_total counter\n"
            f'pdserve_kv_transfer_bytes_total{{role="prefill"}} {value}\n'
        ).encode()


@pytest.fixture
def late_counter():
    counter = _LateCounter(base=100_000.0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the http.server name)
            body = counter.text()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield counter, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_scrape_settled_waits_for_a_late_count(late_counter):
    counter, url = late_counter
    assert serve_metrics.scrape_settled([url])["kv_bytes_sent"] == 100_000 + LATE_BYTES
    assert counter.reads >= 3  # read until two reads agreed


def test_scrape_alone_would_miss_it(late_counter):
    _, url = late_counter
    assert serve_metrics.scrape([url])["kv_bytes_sent"] == 100_000


def test_the_run_does_not_count_the_warm_ups_late_bytes(late_counter, monkeypatch):
    """The load itself sends nothing (both load functions replaced): the
    delta must be 0, not the warm-up's late LATE_BYTES."""
    counter, url = late_counter
    warmed = []
    monkeypatch.setattr(serve, "run_load", lambda *args: warmed.append(args) or {})
    monkeypatch.setattr(serve, "run_sessions",
                        lambda *args, **kw: {"duration_s": 1.0, "requests": []})
    session = Session(arrival_s=0.0, turns=(BenchRequest(prompt=(1, 2, 3, 4, 5),
                                                          max_tokens=2),))
    run = serve.ServeRun(base_url="http://127.0.0.1:1", model="m", sessions=[session],
                         spec=LoadSpec(max_tokens=2), label="x", workload={},
                         metrics_urls=(url,), warmup=1, progress=False)
    result = serve.run_benchmark(run)
    assert len(warmed) == 1
    assert result["server_metrics"]["kv_bytes_sent"] == 0
