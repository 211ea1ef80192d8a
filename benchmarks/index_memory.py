"""`pdserve bench index-memory`: what the router's prefix index costs in
memory, per pod and per cached block (issue 43: "prefix-index memory stated
per pod and per cached block").

The router's `PrefixIndex` (router/cache_index/index.py) is filled as the
pods' cache events fill it: one snapshot batch per pod of `--blocks` random
64-bit block hashes (the engine's hashes are uniform 64-bit values too), for
each pod count in `--pods`. The Python heap it holds is measured with
`tracemalloc` (what the index allocated, not the process's RSS), and the
baseline is the same index empty: bytes per pod = (filled - empty) / pods,
bytes per block = that / blocks. Its CPU per applied block is timed too
(a pod's incremental batch applies the same loop).
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

HELP = ("Prefix-index memory per pod and per cached block, and its CPU per applied "
        "block (router/cache_index/index.py).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", default="10,100,1000", help="pod counts, comma-separated")
    parser.add_argument("--blocks", type=int, default=1000,
                        help="cached blocks per pod (each pod's snapshot)")
    parser.add_argument("--seed", type=int, default=0)


def measure(num_pods: int, num_blocks: int, seed: int) -> dict:
    from proto import pdserve_pb2
    from router.cache_index.index import PrefixIndex

    rng = random.Random(seed)
    batches = [pdserve_pb2.CacheEventBatch(
        address=f"10.0.{i // 256}.{i % 256}:50051", role="prefill", generation=1, block_size=16,
        sequence=1, snapshot=True, stored=[rng.getrandbits(64) for _ in range(num_blocks)])
        for i in range(num_pods)]
    timed = PrefixIndex()  # timed without tracemalloc, which slows allocation
    started = time.perf_counter()
    for batch in batches:
        timed.apply(batch)
    seconds = time.perf_counter() - started
    del timed
    tracemalloc.start()
    index = PrefixIndex()
    before = tracemalloc.get_traced_memory()[0]
    for batch in batches:
        index.apply(batch)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert index.num_blocks() == num_pods * num_blocks
    held = after - before
    return {"pods": num_pods, "blocks_per_pod": num_blocks, "bytes": held,
            "bytes_per_pod": held / num_pods, "bytes_per_block": held / (num_pods * num_blocks),
            "apply_us_per_block": 1e6 * seconds / (num_pods * num_blocks)}


def main(args: argparse.Namespace) -> int:
    print("| pods | blocks per pod | index MiB | per pod KiB | per block B | apply us/block |")
    print("|---:|---:|---:|---:|---:|---:|")
    for pods in (int(p) for p in args.pods.split(",") if p):
        r = measure(pods, args.blocks, args.seed)
        print(f"| {pods} | {args.blocks} | {r['bytes'] / 2**20:.1f} "
              f"| {r['bytes_per_pod'] / 1024:.1f} | {r['bytes_per_block']:.0f} "
              f"| {r['apply_us_per_block']:.2f} |")
    return 0
