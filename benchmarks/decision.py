"""`pdserve bench decision`: one router's routing decision among many pods,
in-process (issue 43: "routing decision p99 <= 1 ms" at 250 P / 750 D).

A `PolledPodPool` over `--prefill` + `--decode` static addresses gets every
pod's load report injected as its stream would deliver it (no network, so
the figure is the router's own work, not the machine's other processes),
and each prefill pod's snapshot of `--cached-blocks` block hashes in the
prefix index.
Between decisions the load changes as it does under traffic: `--churn`
pods get a new report and the chosen decode pod a tracked request (the
last 50 stay in flight). Each iteration times `choose_prefill` (no session:
the placement mode's work) and `choose_decode` for a random 512-token
prompt, and, as the baseline in the same run, the decode ranking by one
pass over every pod's `PodLoad` (`pods()` + the full cost tuple: the design
before router/registry/pod_views.py; `full_ranking`). Prints p50/p99/mean
per choice.

`--decode-cached-blocks N` has each decode pod publish N blocks (decode pods
serving with `--prefix-cache`), and `--history` conversations' prompts are
each published by 1-3 decode pods; half the decisions then send one of
them plus a new message (a next turn, whose holders the choice ranks), half
a fresh prompt. The baseline then ranks every pod by its cached prefix too,
as the choice did before it asked the index for the holders only.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time

HELP = ("Routing decision time among N pods in-process (choose_prefill, choose_decode "
        "against a full scan of every pod).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=250, help="prefill pods")
    parser.add_argument("--decode", type=int, default=750, help="decode pods")
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--churn", type=int, default=2,
                        help="pods of each role given a new report between decisions")
    parser.add_argument("--routing-policy", default="cache-aware")
    parser.add_argument("--cached-blocks", type=int, default=128,
                        help="prefix blocks each prefill pod's events put in the index")
    parser.add_argument("--decode-cached-blocks", type=int, default=0,
                        help="blocks each decode pod publishes (0: decode pods without "
                             "their prefix cache, the default)")
    parser.add_argument("--history", type=int, default=50,
                        help="conversations whose prompts decode pods hold "
                             "(with --decode-cached-blocks)")
    parser.add_argument("--seed", type=int, default=0)


def full_ranking(pods, num_tokens: int, index=None, prompt=(), epsilon: float = 0.25) -> str | None:
    """router/routing/policy.py's decode rule as one pass over every pod in
    `pods` (healthy, not excluded): room, then (given an index and a
    prompt) the cached prefix of the pods within the load bound (over the
    pods that could hold the request), then sequences, free blocks, address.
    None: no pod could ever hold the request. The reference the choice is
    checked against (tests/router/test_decode_choice.py) and timed against."""
    from router.cache_index.index import PromptBlocks

    def need(p) -> int:
        return math.ceil(num_tokens / p.block_size)

    fitting = [p for p in pods if need(p) <= p.num_total_blocks]
    if not fitting:
        return None
    average = sum(p.num_running + p.in_flight for p in fitting) / len(fitting)
    bound = max((1 + epsilon) * average, average + 1)
    blocks = PromptBlocks(prompt) if index is not None and prompt and len(fitting) > 1 else None

    def rank(p):
        load = p.num_running + p.in_flight
        cached = index.cached_tokens(p.address, blocks) if blocks and load <= bound else 0
        return (need(p) > p.num_free_blocks, -cached, load, -p.num_free_blocks, p.address)
    return min(fitting, key=rank).address


async def _run(args: argparse.Namespace) -> tuple[dict[str, list[float]], int]:
    from proto import pdserve_pb2
    from router.cache_index.index import PrefixIndex, PromptBlocks
    from router.registry.poller import PolledPodPool
    from router.registry.static import StaticPodSource
    from router.routing.policy import RoutingPolicy
    from router.sessions import InMemorySessionStore

    def address(role: int, i: int) -> str:
        return f"10.{role}.{i // 250}.{i % 250}:9000"

    prefill = [address(0, i) for i in range(args.prefill)]
    decode = [address(1, i) for i in range(args.decode)]
    pool = PolledPodPool(StaticPodSource(prefill=prefill, decode=decode), watch=False)
    pool._sync(await pool._source.discover())
    rng = random.Random(args.seed)

    def report(role: str) -> pdserve_pb2.LoadReport:
        return pdserve_pb2.LoadReport(
            role=role, generation=1, num_waiting=rng.randint(0, 3),
            num_waiting_tokens=rng.randint(0, 2000), num_running=rng.randint(0, 30),
            num_free_blocks=rng.randint(0, 500), num_total_blocks=500, block_size=16)

    for record in pool._pods.values():
        pool._apply(record, report(record.entry.role), "benchmark")
    index = PrefixIndex()
    history = [[rng.randrange(49152) for _ in range(448)]
               for _ in range(args.history if args.decode_cached_blocks else 0)]
    published: dict[str, list[int]] = {a: [] for a in decode}
    if args.decode_cached_blocks:
        for prompt in history:
            for address in rng.sample(decode, rng.randint(1, 3)):
                published[address] += PromptBlocks(prompt).hashes(16)
    for role, addresses, count in (("prefill", prefill, args.cached_blocks),
                                   ("decode", decode, args.decode_cached_blocks)):
        for address in addresses:  # what the pods' events told the router
            if count:
                index.apply(pdserve_pb2.CacheEventBatch(
                    address=address, role=role, generation=1, block_size=16, sequence=1,
                    snapshot=True, stored=published.get(address, []) + [
                        rng.getrandbits(64) for _ in range(count)]))
    policy = RoutingPolicy(pool, InMemorySessionStore(), mode=args.routing_policy,
                           index=index)
    times: dict[str, list[float]] = {"choose_prefill": [], "choose_decode": [],
                                     "full scan (baseline)": []}
    hits = 0
    held = []
    for _ in range(args.iterations):
        if args.decode_cached_blocks and rng.random() < 0.5:  # a next turn
            prompt = rng.choice(history) + [rng.randrange(49152) for _ in range(64)]
        else:
            prompt = [rng.randrange(49152) for _ in range(512)]
        t0 = time.perf_counter()
        await policy.choose_prefill(session_id=None, prompt_token_ids=prompt)
        t1 = time.perf_counter()
        chosen = policy.choose_decode(num_tokens=576, prompt_token_ids=prompt)
        t2 = time.perf_counter()
        baseline = (full_ranking(pool.pods("decode"), 576, index, prompt)
                    if args.decode_cached_blocks else full_ranking(pool.pods("decode"), 576))
        t3 = time.perf_counter()
        if baseline != chosen:
            raise AssertionError(f"the walk chose {chosen}, a full scan {baseline}")
        hits += bool(args.decode_cached_blocks) and bool(index.cached_tokens(
            chosen, PromptBlocks(prompt)))
        times["choose_prefill"].append(t1 - t0)
        times["choose_decode"].append(t2 - t1)
        times["full scan (baseline)"].append(t3 - t2)
        track = policy.track(chosen)
        track.__enter__()
        held.append(track)
        if len(held) > 50:
            held.pop(0).__exit__(None, None, None)
        for _ in range(args.churn):
            for role, addresses in (("prefill", prefill), ("decode", decode)):
                pool._apply(pool._pods[rng.choice(addresses)], report(role), "benchmark")
    await pool.close()
    return times, hits


def main(args: argparse.Namespace) -> int:
    times, hits = asyncio.run(_run(args))
    print(f"{args.prefill} prefill + {args.decode} decode pods, {args.iterations} decisions, "
          f"{args.routing_policy}, {args.churn} reports per role between decisions")
    if args.decode_cached_blocks:
        print(f"decode pods publish {args.decode_cached_blocks} blocks each and hold "
              f"{args.history} conversations; {hits} decode choices went to a pod caching "
              f"part of the prompt")
    print(f"{'choice':<24}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    for name, values in times.items():
        values.sort()
        p50 = values[len(values) // 2] * 1e6
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))] * 1e6
        mean = sum(values) / len(values) * 1e6
        print(f"{name:<24}{p50:>10.1f}{p99:>10.1f}{mean:>10.1f}")
    scan = sorted(times["full scan (baseline)"])[len(times["full scan (baseline)"]) // 2]
    walk = sorted(times["choose_decode"])[len(times["choose_decode"]) // 2]
    print(f"decode choice p50: {scan / walk:.1f}x faster than the full scan")
    return 0
