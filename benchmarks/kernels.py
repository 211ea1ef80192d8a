"""`pdserve bench kernels`: each Triton kernel against copy bandwidth and its torch reference.

For every kernel and grid point it reports the median time
(`triton.testing.do_bench`), the bytes the kernel must move divided by that
time, the ratio to a plain device-to-device copy's bandwidth measured in the
same run (the roofline for these memory-bound kernels), and the torch
reference's time on the same inputs (the baseline). Targets (H100/H200):
decode attention >= 70% of copy bandwidth at batch 64, context 4096, block
128, and >= 3x the torch reference; inject/extract >= 80%.

Needs CUDA. Without it the command refuses, unless `--cpu-smoke` asks for a
tiny run of the same harness on CPU (torch reference only, wall-clock
timer) that proves the benchmark itself works.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kernels

HELP = "Kernel micro-benchmarks: Triton vs copy bandwidth and vs the torch reference."

# Llama-3-8B attention shapes.
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN = 32, 8, 128, 4096
TARGET_DECODE_POINT = (64, 4096, 128)  # batch, context, block


@dataclass(frozen=True, slots=True)
class Row:
    kernel: str
    batch: int
    context: int
    block_size: int
    bytes_moved: int
    triton_ms: float | None
    torch_ms: float | None

    def gbps(self) -> float | None:
        return None if self.triton_ms is None else self.bytes_moved / self.triton_ms / 1e6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128, 256])
    parser.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="bf16")
    parser.add_argument("--max-gib", type=float, default=12.0,
                        help="skip grid points whose KV cache exceeds this (default 12)")
    parser.add_argument("--reference-max-gib", type=float, default=8.0,
                        help="skip the torch reference where its gathers exceed this (default 8)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny CPU run of the harness (torch reference only)")


def main(args: argparse.Namespace) -> int:
    if args.cpu_smoke:
        return _run(args, torch.device("cpu"), batches=[1, 4], contexts=[64, 256],
                    block_sizes=[16, 128])
    if not torch.cuda.is_available():
        print("pdserve bench kernels needs a CUDA device (none found). "
              "Use --cpu-smoke for a tiny CPU run of the harness.")
        return 2
    return _run(args, torch.device("cuda"), args.batches, args.contexts, args.block_sizes)


def _run(args: argparse.Namespace, device: torch.device, batches: list[int],
         contexts: list[int], block_sizes: list[int]) -> int:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    timer = _cuda_timer if device.type == "cuda" else _cpu_timer
    copy_gbps = _copy_bandwidth(device, timer)
    print(f"device: {_device_name(device)}; dtype {args.dtype}; "
          f"device-to-device copy: {copy_gbps:.1f} GB/s (read + write)")
    rows: list[Row] = []
    budget = int(args.max_gib * 2**30)
    ref_budget = int(args.reference_max_gib * 2**30)
    for block_size in block_sizes:
        for context in contexts:
            for batch in batches:
                if _kv_bytes(batch, context, dtype) > budget:
                    continue
                rows += _bench_point(batch, context, block_size, dtype, device, timer,
                                     ref_budget)
    for block_size in block_sizes:
        for context in contexts:
            rows.append(_bench_prefill(context, block_size, dtype, device, timer, ref_budget))
    for tokens in sorted(set(batches) | set(contexts)):
        rows += _bench_pointwise(tokens, dtype, device, timer)
    _print_table(rows, copy_gbps)
    _print_targets(rows, copy_gbps, device)
    return 0


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _cuda_timer(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _cpu_timer(fn: Callable[[], object]) -> float:
    fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _copy_bandwidth(device: torch.device, timer: Callable) -> float:
    numel = (1 << 28) if device.type == "cuda" else (1 << 22)  # 512 MiB / 8 MiB of bf16
    src = torch.randn(numel, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _kv_bytes(batch: int, context: int, dtype: torch.dtype) -> int:
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize


def _paged_inputs(batch: int, context: int, block_size: int, dtype: torch.dtype,
                  device: torch.device):
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn((2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM),
                           device=device, dtype=dtype)
    # Shuffled blocks: a long-running server's block pool is never in order.
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = order.view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn((batch, NUM_Q_HEADS, HEAD_DIM), device=device, dtype=dtype)
    slots = (block_tables.to(torch.int64)[:, :, None] * block_size
             + torch.arange(block_size, device=device)).view(batch, -1)[:, :context].reshape(-1)
    return q, kv_cache, block_tables, context_lens, slots


def _timed(timer: Callable, backend: str, fn: Callable[[str], object]) -> float:
    """Time `fn(backend)`: every op here takes the kernel backend as an argument."""
    return timer(lambda: fn(backend))


def _bench_point(batch: int, context: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, timer: Callable, ref_budget: int) -> list[Row]:
    q, kv_cache, tables, lens, slots = _paged_inputs(batch, context, block_size, dtype, device)
    on_gpu = device.type == "cuda"
    scale = HEAD_DIM**-0.5
    kv_read = _kv_bytes(batch, context, dtype)
    # The reference gathers K and V (one copy in the cache dtype, one in fp32):
    # about 3x the KV bytes at 16 bits; skip it where that cannot fit.
    run_ref = kv_read + kv_read * 4 // dtype.itemsize <= ref_budget

    def attention(backend: str) -> object:
        return kernels.paged_decode_attention(q, kv_cache, tables, lens, scale=scale,
                                              backend=backend)

    rows = [Row("decode_attention", batch, context, block_size,
                kv_read + 2 * q.numel() * q.element_size() + tables.numel() * 4,
                _timed(timer, "triton", attention) if on_gpu else None,
                _timed(timer, "torch", attention) if run_ref else None)]
    src = kernels.extract_kv(kv_cache, slots)
    moved = 2 * src.numel() * src.element_size() + slots.numel() * 8
    for name, fn in (
        ("inject_kv", lambda b: kernels.inject_kv(kv_cache, src, slots, backend=b)),
        ("extract_kv", lambda b: kernels.extract_kv(kv_cache, slots, src, backend=b)),
    ):
        rows.append(Row(name, batch, context, block_size, moved,
                        _timed(timer, "triton", fn) if on_gpu else None,
                        _timed(timer, "torch", fn) if run_ref else None))
    return rows


def _bench_prefill(context: int, block_size: int, dtype: torch.dtype, device: torch.device,
                   timer: Callable, ref_budget: int) -> Row:
    """One whole prompt of `context` tokens; bytes = one pass over q, K, V and out."""
    q, kv_cache, tables, lens, _ = _paged_inputs(1, context, block_size, dtype, device)
    q = torch.randn((context, NUM_Q_HEADS, HEAD_DIM), device=device, dtype=dtype)
    starts = torch.tensor([0, context], dtype=torch.int32, device=device)

    def attention(backend: str) -> object:
        return kernels.paged_prefill_attention(q, kv_cache, tables, starts, lens,
                                               scale=HEAD_DIM**-0.5, backend=backend)

    moved = _kv_bytes(1, context, dtype) + 2 * q.numel() * q.element_size()
    # The reference materialises fp32 scores and probabilities [Hq, L, L].
    run_ref = 2 * NUM_Q_HEADS * context * context * 4 <= ref_budget
    return Row("prefill_attention", 1, context, block_size, moved,
               _timed(timer, "triton", attention) if device.type == "cuda" else None,
               _timed(timer, "torch", attention) if run_ref else None)


def _bench_pointwise(tokens: int, dtype: torch.dtype, device: torch.device,
                     timer: Callable) -> list[Row]:
    on_gpu = device.type == "cuda"
    x = torch.randn((tokens, HIDDEN), device=device, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn((HIDDEN,), device=device, dtype=dtype)
    q = torch.randn((tokens, NUM_Q_HEADS, HEAD_DIM), device=device, dtype=dtype)
    k = torch.randn((tokens, NUM_KV_HEADS, HEAD_DIM), device=device, dtype=dtype)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    cos_sin = torch.randn((8192, HEAD_DIM), device=device)
    norm_bytes = 4 * x.numel() * x.element_size()  # read x, residual; write y, r
    rope_bytes = 2 * (q.numel() + k.numel()) * q.element_size() + tokens * HEAD_DIM * 4
    rows = []
    for name, moved, fn in (
        ("rms_norm+residual", norm_bytes,
         lambda b: kernels.rms_norm(x, weight, 1e-5, residual, backend=b)),
        ("rotary", rope_bytes,
         lambda b: kernels.rotary_embedding(positions, q, k, cos_sin, backend=b)),
    ):
        rows.append(Row(name, tokens, 0, 0, moved,
                        _timed(timer, "triton", fn) if on_gpu else None,
                        _timed(timer, "torch", fn)))
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_table(rows: list[Row], copy_gbps: float) -> None:
    print("\n| kernel | batch/tokens | context | block | triton ms | GB/s | % of copy "
          "| torch ms | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gbps = r.gbps()
        share = None if gbps is None else 100 * gbps / copy_gbps
        speedup = (None if r.triton_ms is None or r.torch_ms is None
                   else r.torch_ms / r.triton_ms)
        print(f"| {r.kernel} | {r.batch} | {r.context or '-'} | {r.block_size or '-'} | "
              f"{_fmt(r.triton_ms, '.4f')} | {_fmt(gbps, '.1f')} | {_fmt(share, '.1f')} | "
              f"{_fmt(r.torch_ms, '.4f')} | {_fmt(speedup, '.1f')} |")


def _print_targets(rows: list[Row], copy_gbps: float, device: torch.device) -> None:
    if device.type != "cuda":
        print("\n(cpu smoke run: no Triton timings, targets not evaluated)")
        return
    at_point = {r.kernel: r for r in rows
                if (r.batch, r.context, r.block_size) == TARGET_DECODE_POINT}
    checks = [("decode_attention", 0.70, 3.0), ("inject_kv", 0.80, None),
              ("extract_kv", 0.80, None)]
    print(f"\ntargets at batch {TARGET_DECODE_POINT[0]}, context {TARGET_DECODE_POINT[1]}, "
          f"block {TARGET_DECODE_POINT[2]}:")
    for kernel, share_target, speedup_target in checks:
        row = at_point.get(kernel)
        if row is None or row.gbps() is None:
            print(f"  {kernel}: point not in this run's grid")
            continue
        share = row.gbps() / copy_gbps
        verdict = "PASS" if share >= share_target else "FAIL"
        print(f"  {kernel}: {100 * share:.1f}% of copy (target {100 * share_target:.0f}%) "
              f"{verdict}")
        if speedup_target is not None and row.torch_ms is not None:
            speedup = row.torch_ms / row.triton_ms
            verdict = "PASS" if speedup >= speedup_target else "FAIL"
            print(f"  {kernel}: {speedup:.1f}x the torch reference "
                  f"(target {speedup_target:.0f}x) {verdict}")
