"""Open-loop mode of `pdserve bench router` (`--open-loop`): router-added
latency with 200 streams held open, measured by probes that arrive at a
fixed rate well below capacity.

Why: the closed loop at 200 streams saturates this 2-core machine, so its
latencies are queueing (Little's law), not the router. Here the load is
fixed and the same for both clients:

* background — `--background` long requests (`--background-tokens` output
  tokens each, `ignore_eos`) are opened through the client under test and
  read to the end; one that finishes is replaced, so the count stays put.
  They keep the decode pod's batch, the router's relay and the client busy
  exactly as 200 concurrent users would;
* probes — short requests (`--prompt-tokens` in, `--probe-tokens` out)
  launched at seeded Poisson arrival times (`--rate` per second for
  `--duration` seconds), each on its own task (open loop: a slow probe
  never delays the next arrival). The schedule and prompts of round r are
  the same for both clients.

A round = start the background, wait until every stream has its first
token, run the probes, stop the background, wait until the decode pod's
batch is empty. Rounds alternate direct / router. Reported per client:
probe TTFT, end-to-end and inter-token latency (mean gap after the first
token, per probe) p50/p99, the background streams open when each probe
arrived, and each process's CPU share during the probe window — and the
difference router - direct, and the router's CPU per output token it
relayed in the window (router client).

The clients themselves are benchmarks/open_loop_clients.py. Everything
here runs on the benchmark's own event loop (`asyncio.run` in
benchmarks.router.main).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from benchmarks.open_loop_clients import (
    OpenStream,
    direct_client,
    router_client,
    router_http_client,
)


@dataclass(frozen=True, slots=True)
class OpenLoopSettings:
    background: int
    background_tokens: int
    rate: float
    duration: float
    probe_tokens: int
    prompt_tokens: int
    rounds: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.background < 0:
            raise ValueError(f"--background must be >= 0 streams, got {self.background}")
        if self.background_tokens < 2 or self.probe_tokens < 2:
            raise ValueError("--background-tokens and --probe-tokens must be >= 2 (inter-token "
                             f"latency needs two tokens), got {self.background_tokens} and "
                             f"{self.probe_tokens}")
        if not 0 < self.rate <= 1000 or self.duration <= 0 or self.rounds <= 0:
            raise ValueError(f"--rate must be in (0, 1000] per second, --duration and --rounds "
                             f"> 0; got {self.rate}, {self.duration}, {self.rounds}")


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe request as its client saw it."""

    ttft_s: float
    e2e_s: float
    itl_s: float  # mean gap between output tokens after the first
    open_streams: int  # background streams open when it was launched


@dataclass(frozen=True, slots=True)
class RoundResult:
    probes: list[Probe]
    failures: list[str]
    cpu_share: dict[str, float]  # process -> CPU seconds / probe-window seconds
    load_average: float  # 1-minute, at the end of the probe window
    window_s: float = 0.0  # the probe window's length
    tokens: int = 0  # output tokens the client received (background + probes) in the window

    def cpu_us_per_token(self, process: str) -> float:
        """`process`'s CPU time per output token relayed in the window (µs)."""
        return self.cpu_share[process] * self.window_s / max(self.tokens, 1) * 1e6


def arrival_times(rate: float, duration: float, seed: int) -> list[float]:
    """Seconds after the window opens of a Poisson process at `rate`."""
    rng, times, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return times
        times.append(t)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of every thread of `pid` and of its live child
    processes (router workers) so far (Linux). Read from the process's CPU
    clock, which counts nanoseconds: /proc's stat counts 10 ms ticks, and a
    one-second window of a light server can round to zero of them."""
    seconds = _process_cpu_clock(pid)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as children:
                child_pids = [int(c) for c in children.read().split()]
        except FileNotFoundError:  # the thread ended while we listed
            continue
        for child in child_pids:
            try:
                seconds += cpu_seconds(child)
            except FileNotFoundError:
                pass
    return seconds


def _process_cpu_clock(pid: int) -> float:
    """The CPU clock of another process, as clock_getcpuclockid(3) names it
    (`((~pid) << 3) | 2`: the scheduler's own runtime of all its threads);
    FileNotFoundError once the process is gone, like /proc's files."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError as error:
        raise FileNotFoundError(f"process {pid} is gone") from error


async def timed(stream: AsyncIterator[int], open_streams: int) -> Probe:
    """Read a probe's stream to the end, timing its tokens."""
    started = time.perf_counter()
    first = last = None
    count = 0
    async for num_tokens in stream:
        now = time.perf_counter()
        if first is None:
            first, count = now, num_tokens - 1
        else:
            count += num_tokens
        last = now
    if first is None or last is None:
        raise RuntimeError("the probe's stream ended without a token")
    end = time.perf_counter()
    itl = (last - first) / count if count > 0 else 0.0
    return Probe(first - started, end - started, itl, open_streams)


class Background:
    """`count` long streams kept open through one client, each on its own task."""

    def __init__(self, open_stream: OpenStream, count: int, max_tokens: int,
                 prompts: list[list[int]], tag: str) -> None:
        self._open_stream = open_stream
        self._count = count
        self._max_tokens = max_tokens
        self._prompts = prompts
        self._tag = tag
        self.open = 0  # streams that have their first token and are not done
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._hold(i)) for i in range(self._count)]

    async def _hold(self, slot: int) -> None:
        for n in range(1_000_000):
            request_id = f"bg-{self._tag}-{slot}-{n}"
            prompt = self._prompts[slot % len(self._prompts)]
            counted = False
            try:
                async for _ in self._open_stream(request_id, prompt, self._max_tokens):
                    if not counted:
                        self.open, counted = self.open + 1, True
            finally:
                if counted:
                    self.open -= 1

    async def wait_open(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.open < self._count:
            failed = [t for t in self._tasks if t.done()]
            if failed:
                raise RuntimeError(f"a background stream failed: {failed[0].exception()!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self.open}/{self._count} background streams open "
                                   f"after {timeout:g}s")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        errors = [r for r in results if not isinstance(r, asyncio.CancelledError | type(None))]
        if errors:
            raise RuntimeError(f"{len(errors)} background streams failed: {errors[0]!r}")


async def run_round(open_stream: OpenStream, settings: OpenLoopSettings, round_index: int,
                    tag: str, pids: dict[str, int],
                    wait_idle: Callable[[], asyncio.Future | object]) -> RoundResult:
    """One round through one client; see the module docstring."""
    received = [0]  # output tokens through this client so far

    client_stream = open_stream

    async def counted(request_id: str, prompt: list[int], max_tokens: int
                      ) -> AsyncIterator[int]:
        async for num_tokens in client_stream(request_id, prompt, max_tokens):
            received[0] += num_tokens
            yield num_tokens

    open_stream = counted
    rng = random.Random(settings.seed * 1000 + round_index)
    probe_prompts = [[rng.randrange(5, 1000) for _ in range(settings.prompt_tokens)]
                     for _ in range(64)]
    bg_prompts = [[rng.randrange(5, 1000) for _ in range(settings.prompt_tokens)]
                  for _ in range(64)]
    schedule = arrival_times(settings.rate, settings.duration, settings.seed + round_index)
    background = Background(open_stream, settings.background, settings.background_tokens,
                            bg_prompts, tag)
    background.start()
    probes: list[Probe] = []
    failures: list[str] = []
    try:
        await background.wait_open(timeout=120)
        await asyncio.sleep(1.0)  # past the ramp's prefill burst

        async def probe(i: int) -> None:
            stream = open_stream(f"probe-{tag}-{i}", probe_prompts[i % 64], settings.probe_tokens)
            try:
                probes.append(await timed(stream, background.open))
            except Exception as exc:  # noqa: BLE001 - every failure is reported, none hides
                failures.append(repr(exc))

        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        tokens_before = received[0]
        window_start = time.perf_counter()
        tasks = []
        for i, at in enumerate(schedule):
            delay = window_start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(probe(i)))
        await asyncio.gather(*tasks)
        window = time.perf_counter() - window_start
        tokens = received[0] - tokens_before
        cpu_share = {name: (cpu_seconds(pid) - cpu_before[name]) / window
                     for name, pid in pids.items()}
        load = os.getloadavg()[0]
    finally:
        await background.stop()
    await wait_idle()
    return RoundResult(probes, failures, cpu_share, load, window, tokens)


async def measure(settings: OpenLoopSettings, prefill: str, decode: str, router: str,
                  pids: dict[str, int], router_http: str | None = None
                  ) -> dict[str, list[RoundResult]]:
    """Alternating rounds direct / router; every round's results per client.
    With `router_http` (the router's base URL) the router client is the HTTP
    front door (`router_http_client`), else gRPC."""
    import aiohttp
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc as rpc

    options = [("grpc.max_concurrent_streams", 1000)]
    channels = [grpc.aio.insecure_channel(a, options=options) for a in (prefill, decode, router)]
    prefill_stub, decode_stub = rpc.PrefillStub(channels[0]), rpc.DecodeStub(channels[1])
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None))
    if router_http is None:
        router_stream = router_client(pb, rpc.RouterStub(channels[2]))
    else:
        async with http.get(f"{router_http}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        router_stream = router_http_client(http, router_http, model)
    clients = {"direct": direct_client(pb, prefill_stub, decode_stub), "router": router_stream}

    async def wait_idle() -> None:
        """Until both pods have nothing running or queued (the last round's
        cancelled streams are freed), so no round inherits another's load."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            loads = [await stub.GetLoad(pb.LoadRequest()) for stub in (prefill_stub, decode_stub)]
            if all(load.num_running == 0 and load.num_waiting == 0 for load in loads):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("the pods did not go idle within 60 s after a round")

    results: dict[str, list[RoundResult]] = {name: [] for name in clients}
    try:
        for r in range(settings.rounds):
            for name, client in clients.items():
                t0 = time.perf_counter()
                result = await run_round(client, settings, r, f"{name}{r}", pids, wait_idle)
                results[name].append(result)
                print(f"  round {r + 1}, {name:6s}: {len(result.probes)} probes, "
                      f"{len(result.failures)} failed, load average {result.load_average:.2f}, "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        await http.close()
        for channel in channels:
            await channel.close()
    return results


def report(results: dict[str, list[RoundResult]], settings: OpenLoopSettings,
           percentile: Callable[[list[float], float], float]) -> None:
    print(f"\nopen loop: {settings.background} background streams ({settings.background_tokens} "
          f"output tokens each) held open; probes at {settings.rate:g}/s (Poisson, seed "
          f"{settings.seed}) for {settings.duration:g} s per round, {settings.rounds} rounds per "
          f"client; prompt {settings.prompt_tokens} tokens, {settings.probe_tokens} output "
          "tokens per probe; ms\n")
    print("| client | probes | failed | open streams min | TTFT p50 | TTFT p99 | e2e p50 | "
          "e2e p99 | ITL p50 | ITL p99 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    stats: dict[str, list[float]] = {}
    for name, rounds in results.items():
        probes = [p for r in rounds for p in r.probes]
        failed = sum(len(r.failures) for r in rounds)
        if not probes:
            print(f"| {name} | 0 | {failed} | | | | | | | |")
            continue
        values = []
        for field in ("ttft_s", "e2e_s", "itl_s"):
            series = [getattr(p, field) * 1e3 for p in probes]
            values += [percentile(series, 50), percentile(series, 99)]
        stats[name] = values
        print(f"| {name} | {len(probes)} | {failed} | {min(p.open_streams for p in probes)} | "
              + " | ".join(f"{v:.2f}" for v in values) + " |")
    if len(stats) == 2:
        added = [r - d for r, d in zip(stats["router"], stats["direct"], strict=True)]
        print("| **added by router** | | | | " + " | ".join(f"{v:+.2f}" for v in added) + " |")
    for name, rounds in results.items():
        for r in rounds:
            for failure in r.failures[:3]:
                print(f"  {name} probe failed: {failure}")
    names = list(next(iter(results.values()))[0].cpu_share)
    print("\nCPU during the probe windows (share of one core, mean over rounds), and the "
          "1-minute load average at the end of each window\n")
    print("| client | " + " | ".join(names) + " | load average |")
    print("|---|" + "---|" * (len(names) + 1))
    for name, rounds in results.items():
        shares = [sum(r.cpu_share[n] for r in rounds) / len(rounds) for n in names]
        loads = ", ".join(f"{r.load_average:.2f}" for r in rounds)
        print(f"| {name} | " + " | ".join(f"{s:.2f}" for s in shares) + f" | {loads} |")
    if "router" in results and "router" in names:
        rounds = results["router"]
        per_token = [r.cpu_us_per_token("router") for r in rounds]
        print("\nrouter CPU per relayed output token (router client; CPU of the router "
              "process in the probe window / output tokens the client received in it): "
              + ", ".join(f"{v:.1f}" for v in per_token) + " µs per round, "
              f"{sum(r.tokens for r in rounds) / sum(r.window_s for r in rounds):.0f} "
              "tokens/s relayed")
