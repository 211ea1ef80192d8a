"""`pdserve bench sse-floor`: what one streamed token costs an aiohttp server
that does nothing else, the floor under the router's CPU per relayed token
(`pdserve bench router --open-loop --front-door http`).

A server process (this module, `--serve`) holds `--streams` SSE responses
open. Every `--step-ms` one timer callback wakes every stream at once, as
the router's Session reader does when a decode pod's step arrives (one
SessionBatch, one future set per request); each stream's task then writes
one event shaped like the router's text chunk (a per-stream template with
the token's text JSON-encoded into it) and waits for the next step. No
gRPC, no detokenizer, no assembler, no metrics: the rest of the router's
per-token work is what it costs above this.

The client (this process, aiohttp, like the router benchmark's) reads every
stream and counts events; after a warm-up it reads the server's CPU time
(/proc) over `--duration` seconds and divides by the events the client
received in that window. Run it on an otherwise idle machine; the client
shares the cores, as in the router benchmark.

`--front-door grpc` is the same floor under the router's gRPC front door
(`pdserve bench router --open-loop --front-door grpc`): a bare grpc.aio
server whose `Router.Generate` streams yield one `GenerateResponse` (the
token's text and id) per step, read by a grpc.aio client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

HELP = ("SSE floor: server CPU per streamed event of a bare aiohttp server, the baseline "
        "under the router's CPU per relayed token.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=200, help="streams held open")
    parser.add_argument("--step-ms", type=float, default=60.0,
                        help="time between steps (every stream gets one event per step)")
    parser.add_argument("--duration", type=float, default=15.0, help="measured window, s")
    parser.add_argument("--warmup", type=float, default=3.0, help="s before the window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--front-door", choices=("http", "grpc"), default="http",
                        help="SSE over HTTP (aiohttp, default) or Router.Generate over gRPC "
                             "(grpc.aio)")
    parser.add_argument("--serve", type=int, default=None, metavar="PORT",
                        help=argparse.SUPPRESS)  # the server side, started by main


# ------------------------------------------------------------------ server


def _start_steps(waiters: list[asyncio.Future], step_s: float) -> None:
    """Every `step_s`, wake every stream waiting in `waiters` at once, as
    the router's Session reader does when a decode pod's step arrives."""
    loop = asyncio.get_running_loop()

    def step() -> None:
        ready, waiters[:] = list(waiters), []
        for waiter in ready:
            if not waiter.done():
                waiter.set_result(None)
        loop.call_later(step_s, step)

    loop.call_later(step_s, step)


def _serve(port: int, step_s: float) -> None:
    from aiohttp import web

    waiters: list[asyncio.Future] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk = {"id": "cmpl-floor", "object": "text_completion", "created": 0,
                 "model": "floor", "choices": [{"index": 0, "text": "\x01", "logprobs": None,
                                                "finish_reason": None}]}
        before, after = (b"data: " + json.dumps(chunk, separators=(",", ":")).encode()
                         + b"\n\n").split(json.dumps("\x01").encode())
        while True:
            waiter = loop.create_future()
            waiters.append(waiter)
            await waiter
            await response.write(before + json.dumps(" token").encode() + after)

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        app = web.Application()
        app.router.add_get("/stream", stream)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        _start_steps(waiters, step_s)
        print("ready", flush=True)
        await asyncio.Event().wait()

    loop: asyncio.AbstractEventLoop
    asyncio.run(main())


def _serve_grpc(port: int, step_s: float) -> None:
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc

    waiters: list[asyncio.Future] = []

    class Floor(pdserve_pb2_grpc.RouterServicer):
        async def Generate(self, request, context):
            index = 0
            while True:
                waiter = loop.create_future()
                waiters.append(waiter)
                await waiter
                index += 1
                yield pb.GenerateResponse(request_id=request.request_id, text=" token",
                                          token_ids=[1000 + index % 100])

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        server = grpc.aio.server()
        pdserve_pb2_grpc.add_RouterServicer_to_server(Floor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        _start_steps(waiters, step_s)
        print("ready", flush=True)
        await server.wait_for_termination()

    loop: asyncio.AbstractEventLoop
    asyncio.run(main())


# ------------------------------------------------------------------ client


async def _window(read, server_pid: int, args: argparse.Namespace,
                  received: list[int]) -> tuple[float, float]:
    """Run `read()` on every stream; the server's CPU per event received in
    the window after the warm-up, and the events per second."""
    from benchmarks.router_open_loop import cpu_seconds

    tasks = [asyncio.create_task(read(i)) for i in range(args.streams)]
    try:
        await asyncio.sleep(args.warmup)
        cpu0, events0, t0 = cpu_seconds(server_pid), received[0], time.monotonic()
        await asyncio.sleep(args.duration)
        cpu1, events1, t1 = cpu_seconds(server_pid), received[0], time.monotonic()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    events = max(events1 - events0, 1)
    return (cpu1 - cpu0) / events * 1e6, events / (t1 - t0)


async def _measure(port: int, server_pid: int, args: argparse.Namespace) -> tuple[float, float]:
    import aiohttp

    received = [0]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        async def read(_: int) -> None:
            async with http.get(f"http://127.0.0.1:{port}/stream") as response:
                async for line in response.content:
                    if line.startswith(b"data: "):
                        received[0] += 1

        return await _window(read, server_pid, args, received)


async def _measure_grpc(port: int, server_pid: int, args: argparse.Namespace
                        ) -> tuple[float, float]:
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc

    received = [0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)

        async def read(i: int) -> None:
            async for _ in stub.Generate(pb.GenerateRequest(request_id=f"floor-{i}")):
                received[0] += 1

        return await _window(read, server_pid, args, received)


def main(args: argparse.Namespace) -> int:
    grpc_door = args.front_door == "grpc"
    if args.serve is not None:
        (_serve_grpc if grpc_door else _serve)(args.serve, args.step_ms / 1000)
        return 0
    if args.streams <= 0 or args.step_ms <= 0 or args.duration <= 0 or args.rounds <= 0:
        print("--streams, --step-ms, --duration and --rounds must be > 0", file=sys.stderr)
        return 2
    from benchmarks.router_stack import _free_port

    per_event = []
    for r in range(args.rounds):
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "bench", "sse-floor", "--serve", str(port),
             "--step-ms", str(args.step_ms), "--front-door", args.front_door],
            stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != b"ready":
                print("the floor's server did not start", file=sys.stderr)
                return 1
            us, rate = asyncio.run((_measure_grpc if grpc_door else _measure)(
                port, server.pid, args))
        finally:
            server.terminate()
            server.wait(10)
        per_event.append(us)
        print(f"round {r + 1}: {us:.1f} µs of server CPU per event, {rate:.0f} events/s "
              f"({args.streams} streams, a step every {args.step_ms:g} ms)", flush=True)
    ordered = sorted(per_event)
    server_kind = "grpc.aio Router.Generate" if grpc_door else "aiohttp SSE"
    print(f"\nbare {server_kind} floor: median {ordered[len(ordered) // 2]:.1f} µs per event "
          f"(min {ordered[0]:.1f}, max {ordered[-1]:.1f}) over {args.rounds} rounds")
    return 0
