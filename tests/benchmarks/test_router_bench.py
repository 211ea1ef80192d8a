"""`pdserve bench router --open-loop` through the router's HTTP front door
(real pods and router on loopback, the tiny model, a short load), and
`pdserve bench sse-floor`."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import open_loop_clients, router_open_loop, sse_floor
from benchmarks.router_stack import start_stack, stop_stack

pytestmark = pytest.mark.timeout(240)


def test_open_loop_over_http_counts_every_token(tiny_model_dir: Path) -> None:
    settings = router_open_loop.OpenLoopSettings(
        background=4, background_tokens=24, rate=4.0, duration=1.5, probe_tokens=6,
        prompt_tokens=16, rounds=1)
    with tempfile.TemporaryDirectory() as tmp:
        procs, prefill, decode, router, router_http = start_stack(
            tiny_model_dir, Path(tmp), ["--kv-cache-memory=256MiB"])
        try:
            pids = {"router": procs[-1].pid, "client": os.getpid()}
            results = asyncio.run(router_open_loop.measure(
                settings, prefill, decode, router, pids, router_http))
        finally:
            stop_stack(procs)
    for client in ("direct", "router"):
        (result,) = results[client]
        assert result.failures == []
        assert result.probes, client
        assert result.tokens > 0
        for probe in result.probes:
            assert 0 < probe.ttft_s <= probe.e2e_s
    assert results["router"][0].cpu_us_per_token("router") > 0


def test_http_client_reports_each_request_s_whole_output(tiny_model_dir: Path) -> None:
    """The HTTP client yields exactly max_tokens tokens per request (events,
    plus any the final usage shows were held back)."""
    import aiohttp

    async def run(router_http: str) -> list[int]:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{router_http}/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
            stream = open_loop_clients.router_http_client(http, router_http, model)
            totals = []
            for n, max_tokens in enumerate((2, 9, 17)):
                totals.append(sum([c async for c in stream(f"r{n}", [5, 6, 7, 8 + n],
                                                           max_tokens)]))
            return totals

    with tempfile.TemporaryDirectory() as tmp:
        procs, _, _, _, router_http = start_stack(tiny_model_dir, Path(tmp),
                                                  ["--kv-cache-memory=256MiB"])
        try:
            assert asyncio.run(run(router_http)) == [2, 9, 17]
        finally:
            stop_stack(procs)


def test_sse_floor_reports_cpu_per_event(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    sse_floor.add_arguments(parser)
    args = parser.parse_args(["--streams", "8", "--step-ms", "20", "--duration", "1",
                              "--warmup", "0.5", "--rounds", "1"])
    assert sse_floor.main(args) == 0
    out = capsys.readouterr().out
    match = re.search(r"median ([0-9.]+) µs per event", out)
    assert match is not None, out
    assert float(match.group(1)) > 0
    events = int(re.search(r"([0-9]+) events/s", out).group(1))
    # 8 streams, one event each per 20 ms step: ~400/s on an idle machine
    assert 50 <= events <= 450


def test_the_grpc_floor_reports_cpu_per_message() -> None:
    """`--front-door grpc`: the floor under the gRPC front door (grpc.aio on
    both sides). In its own process, for the reason the next test gives."""
    command = [sys.executable, "-m", "pdserve", "bench", "sse-floor", "--front-door", "grpc",
               "--streams", "8", "--step-ms", "20", "--duration", "1", "--warmup", "0.5",
               "--rounds", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r"bare grpc.aio Router.Generate floor: median ([0-9.]+) µs per event",
                      done.stdout)
    assert match is not None, done.stdout
    assert float(match.group(1)) > 0
    events = int(re.search(r"([0-9]+) events/s", done.stdout).group(1))
    assert 50 <= events <= 450


def test_the_whole_open_loop_command_runs_its_phases_on_one_loop(tiny_model_dir: Path) -> None:
    """`pdserve bench router --open-loop` end to end: the rounds, then the
    routing decisions, all on one event loop (two `asyncio.run` calls left
    grpc.aio delivering the cancelled streams' last events to a closed loop).
    In its own process: in this one, calls of earlier tests' loops can still
    deliver their last events to theirs, which this check would also see."""
    command = [
        sys.executable, "-m", "pdserve", "bench", "router",
        "--model", str(tiny_model_dir), "--open-loop", "--front-door", "http",
        "--background", "8", "--background-tokens", "32", "--rate", "4", "--duration", "1.5",
        "--probe-tokens", "4", "--rounds", "1", "--decision-iterations", "50",
        "--pod-arg=--kv-cache-memory=256MiB"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=200,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "router CPU per relayed output token" in done.stdout
    assert re.search(r"\| policy, in-memory sessions \| [0-9.]+ \|", done.stdout)
    # asyncio reports a callback's exception through logging (stderr here)
    assert "Event loop is closed" not in done.stdout + done.stderr
