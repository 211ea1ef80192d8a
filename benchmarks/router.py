"""`pdserve bench router`: latency the router adds, and its routing-decision time.

Setup (all real processes on loopback): one prefill pod, one decode pod and
one `pdserve router` (started here unless --prefill/--decode/--router-grpc
point at running ones), a small model, short outputs, so the pods' own cost is
small and the router's shows.

Two clients run the *same* disaggregated flow at the same concurrency:

* direct — the benchmark plays router itself: Decode.Generate(remote_prefill)
  -> Reserved -> Prefill.Prefill(target) -> first token -> decode stream;
* router — Router.Generate (gRPC) with the same prompt token ids, through
  the router (validation, routing, session store, detokenizing, metrics).

Rounds alternate direct / router so drift on the shared 2-core machine hits
both alike. Reported: time to first token and end-to-end latency p50/p99 of
each, and the difference (router - direct) = latency added by the router.

Routing decision: `RoutingPolicy.choose_prefill` + `choose_decode` timed in
this process over a `PolledPodPool` polling the same pods (sessions spread
over 1,000 ids), with the in-memory and the Redis session store (a throwaway
redis-server when one is installed), one caller and 200 concurrent callers;
plus `choose_bounded` alone over 64 pods.

The processes (pods, router, redis-server, CPU pinning) are started by
benchmarks/router_stack.py; the open loop is benchmarks/router_open_loop.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.router_stack import pin_cpus, start_redis, start_stack, stop_stack

HELP = "Router-added latency (through the router vs. direct to pods) and routing-decision time."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: built-in tiny)")
    parser.add_argument("--concurrency", default="1,16,200",
                        help="comma-separated concurrent stream counts (default 1,16,200)")
    parser.add_argument("--requests", type=int, default=1000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per client (alternating)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--decision-iterations", type=int, default=20000)
    parser.add_argument("--prefill", default=None, help="use this running prefill pod")
    parser.add_argument("--decode", default=None, help="use this running decode pod")
    parser.add_argument("--router-grpc", default=None, help="use this running router (host:port)")
    parser.add_argument("--pin", action="store_true",
                        help="Linux: router on the last CPU, pods and this client on the others "
                             "(router overhead without CPU contention with the pods)")
    parser.add_argument("--pod-arg", action="append", default=[],
                        help="extra flag for the pods started here")
    parser.add_argument("--router-arg", action="append", default=[],
                        help="extra flag for the router started here (e.g. "
                             "--router-arg=--relay=stream for the per-request relay)")
    g = parser.add_argument_group("open loop (--open-loop; see benchmarks/router_open_loop.py)")
    g.add_argument("--open-loop", action="store_true",
                   help="instead of the closed loop: --background streams held open, probes "
                        "arriving at --rate per second (Poisson, seeded)")
    g.add_argument("--background", type=int, default=200, help="streams held open (default 200)")
    g.add_argument("--background-tokens", type=int, default=1024,
                   help="output tokens per background stream (default 1024)")
    g.add_argument("--rate", type=float, default=10.0, help="probe arrivals per second")
    g.add_argument("--duration", type=float, default=30.0, help="probe window per round, s")
    g.add_argument("--probe-tokens", type=int, default=8, help="output tokens per probe")
    g.add_argument("--front-door", choices=("grpc", "http"), default="grpc",
                   help="the router client's front door: Router.Generate over gRPC (default) "
                        "or /v1/completions streamed over HTTP (SSE)")


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    e2e_s: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# ------------------------------------------------------------------ clients


async def direct_request(pb, stubs, request_id: str, prompt: list[int], max_tokens: int
                         ) -> Sample:
    """The router's flow, done by hand: reserve on decode, prefill, stream the rest."""
    import grpc

    prefill_stub, decode_stub = stubs
    sampling = pb.SamplingParams(max_tokens=max_tokens, top_p=1.0, ignore_eos=True)
    started = time.perf_counter()
    call = decode_stub.Generate(pb.DecodeGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling, remote_prefill=True))
    first = await call.read()
    prefill = prefill_stub.Prefill(pb.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
        target=first.reserved.target))
    await prefill.read()  # the first token, before the transfer's verdict
    ttft = time.perf_counter() - started
    while True:
        message = await call.read()
        if message is grpc.aio.EOF or message.tokens.finish_reason:
            break
    finished = time.perf_counter()
    while await prefill.read() is not grpc.aio.EOF:  # the verdict (the decode stream implied it)
        pass
    return Sample(ttft, finished - started)


async def router_request(pb, stub, request_id: str, prompt: list[int], max_tokens: int
                         ) -> Sample:
    sampling = pb.SamplingParams(max_tokens=max_tokens, top_p=1.0, ignore_eos=True)
    started = time.perf_counter()
    ttft = None
    async for message in stub.Generate(pb.GenerateRequest(
            prompt_token_ids=prompt, sampling=sampling, request_id=request_id,
            session_id=f"session-{hash(request_id) % 1000}")):
        if ttft is None and message.token_ids:
            ttft = time.perf_counter() - started
        if message.finish_reason:
            break
    end = time.perf_counter() - started
    return Sample(ttft if ttft is not None else end, end)


async def run_round(make_call, num_requests: int, concurrency: int) -> list[Sample]:
    queue = iter(range(num_requests))
    samples: list[Sample] = []

    async def worker() -> None:
        for i in queue:
            samples.append(await make_call(i))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def measure_latency(args, prefill: str, decode: str, router: str, concurrency: int
                          ) -> dict[str, tuple[list[Sample], float]]:
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc as rpc

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(args.prompt_tokens)] for _ in range(64)]
    channels = [grpc.aio.insecure_channel(a) for a in (prefill, decode, router)]
    direct_stubs = (rpc.PrefillStub(channels[0]), rpc.DecodeStub(channels[1]))
    router_stub = rpc.RouterStub(channels[2])
    results: dict[str, list[Sample]] = {"direct": [], "router": []}
    busy: dict[str, float] = {"direct": 0.0, "router": 0.0}
    try:
        clients = {
            "direct": lambda tag: lambda i: direct_request(
                pb, direct_stubs, f"d{tag}-{i}", prompts[i % 64], args.max_tokens),
            "router": lambda tag: lambda i: router_request(
                pb, router_stub, f"r{tag}-{i}", prompts[i % 64], args.max_tokens),
        }
        for factory in clients.values():  # warm-up: connections, caches
            await run_round(factory("warm"), min(200, args.requests), concurrency)
        for r in range(args.rounds):
            for name, factory in clients.items():
                t0 = time.perf_counter()
                samples = await run_round(factory(f"{concurrency}-{r}"), args.requests,
                                          concurrency)
                elapsed = time.perf_counter() - t0
                results[name].extend(samples)
                busy[name] += elapsed
                print(f"  {concurrency:4d} streams, round {r + 1}, {name:6s}: {len(samples)} "
                      f"requests in {elapsed:.1f} s", flush=True)
    finally:
        for channel in channels:
            await channel.close()
    return {name: (results[name], len(results[name]) / busy[name]) for name in results}


async def _time_policy(policy, args, prompt: list[int], concurrency: int) -> list[float]:
    samples: list[float] = []
    calls = iter(range(args.decision_iterations))

    async def worker() -> None:
        for i in calls:
            t0 = time.perf_counter()
            await policy.choose_prefill(session_id=f"s{i % 1000}", prompt_token_ids=prompt)
            policy.choose_decode(num_tokens=args.prompt_tokens + args.max_tokens)
            samples.append((time.perf_counter() - t0) * 1e6)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def measure_decisions(args, prefill: str, decode: str, redis_url: str | None
                            ) -> dict[str, list[float]]:
    from router.registry.poller import PolledPodPool
    from router.registry.static import StaticPodSource
    from router.routing.policy import RoutingPolicy
    from router.routing.rendezvous import choose_bounded, session_key
    from router.sessions import InMemorySessionStore, RedisSessionStore

    pool = PolledPodPool(StaticPodSource(prefill=[prefill], decode=[decode]))
    await pool.start()
    rng = random.Random(1)
    prompt = [rng.randrange(5, 1000) for _ in range(args.prompt_tokens)]
    results: dict[str, list[float]] = {}
    try:
        memory = RoutingPolicy(pool, InMemorySessionStore())
        results["policy, in-memory sessions"] = await _time_policy(memory, args, prompt, 1)
        results["policy, in-memory sessions, 200 concurrent"] = await _time_policy(
            memory, args, prompt, 200)
        if redis_url is not None:
            store = RedisSessionStore(redis_url)
            try:
                shared = RoutingPolicy(pool, store)
                results["policy, Redis sessions"] = await _time_policy(shared, args, prompt, 1)
                results["policy, Redis sessions, 200 concurrent"] = await _time_policy(
                    shared, args, prompt, 200)
            finally:
                await store.close()
    finally:
        await pool.close()
    loads = {f"10.0.{i // 250}.{i % 250}:50051": float(rng.randrange(0, 5000)) for i in range(64)}
    bounded_us = []
    for i in range(args.decision_iterations):
        t0 = time.perf_counter()
        choose_bounded(session_key(f"s{i}"), loads, epsilon=0.25, slack=32.0)
        bounded_us.append((time.perf_counter() - t0) * 1e6)
    results["choose_bounded alone, 64 pods"] = bounded_us
    return results


def report(runs: dict[int, dict[str, tuple[list[Sample], float]]],
           decisions: dict[str, list[float]], args) -> None:
    if runs:
        report_closed_loop(runs, args)
    print("\nrouting decision: choose_prefill (session) + choose_decode over the polled pods, "
          "in this process; 200 concurrent = 200 tasks calling at once\n")
    print("| decision | p50 µs | p99 µs | mean µs |")
    print("|---|---|---|---|")
    for name, values in decisions.items():
        print(f"| {name} | {percentile(values, 50):.1f} | {percentile(values, 99):.1f} | "
              f"{statistics.fmean(values):.1f} |")


def report_closed_loop(runs: dict[int, dict[str, tuple[list[Sample], float]]], args) -> None:
    print(f"\nrouter-added latency: {args.rounds} x {args.requests} requests per client and "
          f"concurrency, prompt {args.prompt_tokens} tokens, {args.max_tokens} output tokens\n")
    print("| streams | client | req/s | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for concurrency, results in runs.items():
        stats = {}
        for name, (samples, rate) in results.items():
            ttft = [s.ttft_s * 1e3 for s in samples]
            e2e = [s.e2e_s * 1e3 for s in samples]
            stats[name] = [percentile(ttft, 50), percentile(ttft, 99), percentile(e2e, 50),
                           percentile(e2e, 99)]
            print(f"| {concurrency} | {name} | {rate:.0f} | "
                  + " | ".join(f"{v:.2f}" for v in stats[name]) + " |")
        added = [r - d for r, d in zip(stats["router"], stats["direct"], strict=True)]
        print(f"| {concurrency} | **added by router** | | "
              + " | ".join(f"{v:+.2f}" for v in added) + " |")


def _open_loop_settings(args: argparse.Namespace):
    from benchmarks.router_open_loop import OpenLoopSettings

    return OpenLoopSettings(
        background=args.background, background_tokens=args.background_tokens, rate=args.rate,
        duration=args.duration, probe_tokens=args.probe_tokens,
        prompt_tokens=args.prompt_tokens, rounds=args.rounds)


def main(args: argparse.Namespace) -> int:
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) <= 0 or args.requests <= 0 or args.rounds <= 0:
        print("--concurrency (comma-separated), --requests and --rounds must be > 0",
              file=sys.stderr)
        return 2
    try:
        open_loop = _open_loop_settings(args) if args.open_loop else None
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    from benchmarks import router_open_loop

    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-router-") as tmp:
        try:
            router_http = None
            if args.prefill and args.decode and args.router_grpc:
                prefill, decode, router = args.prefill, args.decode, args.router_grpc
            else:
                from engine.make_model import ensure_model

                model = Path(args.model) if args.model else ensure_model("tiny")
                procs, prefill, decode, router, router_http = start_stack(
                    model, Path(tmp), args.pod_arg, args.router_arg)
                if args.pin:
                    print(pin_cpus(procs), flush=True)
            print(f"pods: prefill {prefill}, decode {decode}; router gRPC {router}", flush=True)
            if open_loop is not None:
                pids = dict(zip(("prefill", "decode", "router"), (p.pid for p in procs),
                                strict=False)) | {"client": os.getpid()}
                if args.front_door == "http" and router_http is None:
                    raise SystemExit("--front-door http needs the router started here "
                                     "(not --router-grpc)")

            async def measure_all():
                # One event loop for every phase: grpc.aio keeps delivering to
                # the loop it first ran on, so a later asyncio.run's calls
                # would end in "Event loop is closed" callbacks.
                if open_loop is not None:
                    measured = await router_open_loop.measure(
                        open_loop, prefill, decode, router, pids,
                        router_http if args.front_door == "http" else None)
                else:
                    measured = {c: await measure_latency(args, prefill, decode, router, c)
                                for c in levels}
                redis_proc, redis_url = start_redis(Path(tmp))
                if redis_proc is not None:
                    procs.insert(0, redis_proc)  # stopped last
                return measured, await measure_decisions(args, prefill, decode, redis_url)

            measured, decisions = asyncio.run(measure_all())
        finally:
            stop_stack(procs)
    if open_loop is not None:
        router_open_loop.report(measured, open_loop, percentile)
        report({}, decisions, args)
    else:
        report(measured, decisions, args)
    return 0
