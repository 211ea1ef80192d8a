"""The native C paged decode attention (`kernels/native/paged_decode.c`) on CPU.

Times `kernels.native.paged_decode_attention` (median of many calls, after a
warm-up) over a grid of batch sizes and context lengths at 1 and 2 OpenMP
threads, and prints one table row per point with the bytes of K and V the
call must read divided by its time. Shapes default to the base model's
attention (16 query heads, 4 KV heads, head_dim 64, block 128). Short: a few
seconds for the default grid.

    PYTHONPATH=. python -m benchmarks.native_attention [--dtype bf16]

(as a module: run as a script, `benchmarks/kernels.py` would shadow the
`kernels` package).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from kernels import native

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def time_call(fn, *, min_calls: int, min_seconds: float) -> float:
    """Median seconds of one call of `fn` over at least `min_calls` calls and
    `min_seconds` of calls, after a warm-up."""
    for _ in range(5):
        fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_calls or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(batch: int, context: int, threads: int, args: argparse.Namespace) -> float:
    """Median ms of one call over `batch` sequences of `context` tokens each,
    every sequence on its own blocks of one random cache."""
    dtype = DTYPES[args.dtype]
    blocks_per_seq = math.ceil(context / args.block_size)
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    cache = torch.randn((2, batch * blocks_per_seq + 2, args.block_size, args.kv_heads,
                         args.head_dim), generator=gen).to(dtype)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn((batch, args.q_heads, args.head_dim), generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(args.head_dim)
    seconds = time_call(
        lambda: native.paged_decode_attention(q, cache, tables, lens, scale=scale,
                                              num_threads=threads),
        min_calls=args.calls, min_seconds=args.seconds)
    return seconds * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 2048])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--calls", type=int, default=50, help="at least this many calls per point")
    parser.add_argument("--seconds", type=float, default=0.2,
                        help="and at least this long per point")
    args = parser.parse_args(argv)
    if native.library() is None:
        raise SystemExit("native kernels unavailable (no C compiler?)")
    element = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    print(f"dtype {args.dtype}, Hq {args.q_heads}, Hkv {args.kv_heads}, D {args.head_dim}, "
          f"block {args.block_size}; median ms per call")
    print("| batch | context | threads | ms | K+V GB/s |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for context in args.contexts:
            for threads in args.threads:
                ms = measure(batch, context, threads, args)
                kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * element
                print(f"| {batch} | {context} | {threads} | {ms:.3f} | "
                      f"{kv_bytes / ms / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
