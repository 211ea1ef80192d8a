"""`pdserve router --workers 2`: two worker processes on one HTTP and one
gRPC port (real processes, tiny model, the official `openai` client)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.integration.pods import start_pod
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PROMPT = "The quick brown fox"
NUM_STREAMS = 16


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    pod = start_pod("colocated", tiny_model_dir)
    yield pod
    pod.kill()


def _workers(router_pid: int) -> list[int]:
    children = Path(f"/proc/{router_pid}/task/{router_pid}/children").read_text().split()
    workers = []
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
            workers.append(int(pid))
    return workers


def _established_on(pid: int, port: int) -> int:
    """TCP connections of process `pid` established on local `port`."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


def _requests_ok(router) -> float:
    """pdserve_router_requests_total{outcome="ok"} from one /metrics answer."""
    text = urllib.request.urlopen(router.url("/metrics"), timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('pdserve_router_requests_total{outcome="ok"}'))


def test_two_workers_serve_one_port(colocated, tiny_model_dir):
    router = start_router(tiny_model_dir, colocated=[colocated.address], workers=2)
    try:
        wait_ready(router)
        workers = _workers(router.process.pid)
        assert len(workers) == 2, router.log_tail()
        # closed after use: its keep-alive connection would count as a 17th below
        with openai.OpenAI(base_url=router.base_url, api_key="x", max_retries=0) as client:
            reference = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].text
        held = ThreadPoolExecutor(NUM_STREAMS)
        connections: dict[int, int] = {}

        def stream(i: int) -> str:
            # one client (one connection) per stream: the kernel spreads connections
            client = openai.OpenAI(base_url=router.base_url, api_key="x", max_retries=0)
            chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            text = []
            for n, chunk in enumerate(chunks):
                text.append(chunk.choices[0].text if chunk.choices else "")
                if n == 2:
                    barrier_wait()
            return "".join(text)

        import threading
        barrier = threading.Barrier(NUM_STREAMS + 1)

        def barrier_wait() -> None:
            barrier.wait(timeout=60)
            barrier.wait(timeout=60)  # held open until the connections were counted

        futures = [held.submit(stream, i) for i in range(NUM_STREAMS)]
        barrier.wait(timeout=60)
        for pid in workers:
            connections[pid] = _established_on(pid, router.http_port)
        barrier.wait(timeout=60)
        texts = [f.result(timeout=120) for f in futures]
        held.shutdown()
        assert texts == [reference] * NUM_STREAMS
        assert sum(connections.values()) == NUM_STREAMS
        assert all(count > 0 for count in connections.values()), connections
        # /metrics from any worker counts every worker's requests
        for _ in range(6):
            assert _requests_ok(router) == NUM_STREAMS + 1
        assert router.terminate() == 0
        assert all(not Path(f"/proc/{pid}").exists() for pid in workers)
    finally:
        if router.process.poll() is None:
            router.process.kill()


def test_a_dead_worker_stops_the_router_with_an_error(colocated, tiny_model_dir):
    router = start_router(tiny_model_dir, colocated=[colocated.address], workers=2)
    try:
        wait_ready(router)
        workers = _workers(router.process.pid)
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while router.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert router.process.returncode == 1, router.log_tail()
        assert "exited with status" in router.log_tail()
        time.sleep(0.5)
        assert not Path(f"/proc/{workers[1]}").exists() or \
            Path(f"/proc/{workers[1]}/stat").read_text().split()[2] == "Z"
    finally:
        if router.process.poll() is None:
            router.process.kill()
