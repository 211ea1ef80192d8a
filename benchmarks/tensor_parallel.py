"""`pdserve bench tp`: a model split over N processes against one process,
on the same cores.

Per round, TP=1 (one process, every CPU of this process's affinity as
torch threads) and then TP=N (N processes, each pinned to its share of
those CPUs with one thread per CPU: engine/parallel/placement.py), the
same model, prompts and engine settings:

- **decode step**: B requests with a `--context`-token prompt decode
  `--steps` tokens together; the mean step time of the decode phase;
- **prefill**: one `--prefill-len`-token prompt to its first token.

Beside TP=N's figures, the share of the step rank 0 spends in its
all-reduces (wall time inside `TPGroup.all_reduce`, which includes
waiting for the slower rank). Rounds alternate TP=1 and TP=N; medians and
ranges over the rounds. On CUDA the ranks take cuda:0..N-1 instead.
"""

from __future__ import annotations

import argparse
import statistics
import time

HELP = "Tensor parallelism: decode step and prefill at TP=N against TP=1 on the same cores."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base",
                        help="model dir, .gguf file or name: smollm2-135m-instruct, tiny, base")
    parser.add_argument("--tensor-parallel-size", type=int, default=2, metavar="N")
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch")
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--block-size", type=int, default=128)


class _AllReduceClock:
    """Wall time rank 0 spends inside its group's all_reduce (a wrapper on
    the instance: the model's layers call through the same object)."""

    def __init__(self, group) -> None:
        self.seconds = 0.0
        inner = group.all_reduce

        def timed(x):
            start = time.perf_counter()
            try:
                return inner(x)
            finally:
                self.seconds += time.perf_counter() - start

        group.all_reduce = timed


def _engine(args: argparse.Namespace, size: int, batch: int):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_source import resolve_model

    tokens = max(args.context + args.steps + 2, args.prefill_len + 2)
    num_blocks = max(batch, 1) * -(-tokens // args.block_size) + 4
    return LLMEngine(EngineConfig(
        model_dir=str(resolve_model(args.model)), dtype=args.dtype, device=args.device,
        block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, args.prefill_len), enable_prefix_caching=False,
        tensor_parallel_size=size))


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def _measure(engine, args: argparse.Namespace, batch: int, clock: _AllReduceClock | None
             ) -> dict[str, float]:
    """Decode step (s), its all-reduce share, and the prefill time (s)."""
    import torch

    from engine.sampling_params import SamplingParams

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    waiting = set()
    for i, prompt in enumerate(_prompts(vocab, batch, args.context, batch)):
        waiting.add(request_id := f"d{batch}-{i}-{time.monotonic_ns()}")
        engine.add_request(request_id, prompt, params)
    steps, start, reduce_start = 0, None, 0.0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if start is not None:
            steps += 1
            continue
        waiting.difference_update(o.request_id for o in outputs if o.new_token_ids)
        if not waiting:  # every prompt has its first token: pure decode from here
            sync()
            start, reduce_start = time.perf_counter(), clock.seconds if clock else 0.0
    sync()
    decode_s = (time.perf_counter() - start) / max(steps, 1)
    share = ((clock.seconds - reduce_start) / max(steps, 1) / decode_s) if clock else 0.0
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    (prompt,) = _prompts(vocab, 1, args.prefill_len, 7)
    sync()
    begin = time.perf_counter()
    engine.add_request(f"p-{time.monotonic_ns()}", prompt, one)
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    return {"step": decode_s, "share": share, "prefill": time.perf_counter() - begin}


def _round(args: argparse.Namespace, size: int, batch: int) -> dict[str, float]:
    engine = _engine(args, size, batch)
    try:
        clock = _AllReduceClock(engine.tp.group) if size > 1 else None
        _measure(engine, args, min(batch, 2), clock)  # warm-up
        return _measure(engine, args, batch, clock)
    finally:
        engine.close()


def _all_reduce_floor(rank: int, size: int, init_method: str, shapes: list[tuple[int, int]],
                      shares: list[tuple[int, ...]] | None, out) -> None:
    """One process of the collective alone: `size` processes placed as the
    ranks are, the all-reduce of each decode step's [batch, hidden] shape."""
    import torch
    import torch.distributed as dist

    from engine.parallel.group import join_store
    from engine.parallel.placement import place

    place(shares[rank] if shares else ())
    dist.init_process_group("gloo", store=join_store(init_method, 60.0), rank=rank,
                            world_size=size)
    for shape in shapes:
        x = torch.randn(shape)
        for _ in range(20):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(x)
        if rank == 0:
            out[f"{shape[0]}"] = (time.perf_counter() - start) / 200
    dist.destroy_process_group()


def _floor(size: int, batches: list[int], hidden: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    from engine.parallel.group import host_store
    from engine.parallel.placement import cpu_shares

    manager = mp.Manager()
    out = manager.dict()
    _store, init_method = host_store(60.0)  # every rank joins it as a client
    mp.spawn(_all_reduce_floor, args=(size, init_method, [(b, hidden) for b in batches],
                                      cpu_shares(size), out), nprocs=size)
    return dict(out)


def _spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})")


def main(args: argparse.Namespace) -> int:
    import torch

    n = args.tensor_parallel_size
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[tuple[int, int], list[dict[str, float]]] = {}
    for round_index in range(args.rounds):
        for batch in batches:
            for size in (1, n):
                results.setdefault((size, batch), []).append(_round(args, size, batch))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    if args.device == "cpu":
        from engine.model_config import ModelConfig
        from engine.model_source import resolve_model

        config = ModelConfig.from_pretrained(resolve_model(args.model))
        floor = _floor(n, batches, config.hidden_size)
        print(f"gloo all-reduce alone, {n} processes placed as the ranks: " + ", ".join(
            f"[{b}, {config.hidden_size}] {floor[str(b)] * 1e6:.0f} us" for b in batches)
            + f"; a decode step makes {2 * config.num_hidden_layers + 1} of them")
    print(f"model {args.model}, {args.device} {args.dtype}, block {args.block_size}, context "
          f"{args.context}, {args.steps} decode steps, prefill {args.prefill_len} tokens; "
          f"TP=1 on {torch.get_num_threads()} threads, TP={n} on one share each; "
          f"median (range) of {args.rounds} rounds")
    print(f"| batch | TP=1 step ms | TP={n} step ms | ratio | all-reduce share of the TP={n} "
          f"step | TP=1 prefill ms | TP={n} prefill ms | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        one, many = results[(1, batch)], results[(n, batch)]
        step_ratio = [m["step"] / o["step"] for o, m in zip(one, many, strict=True)]
        prefill_ratio = [m["prefill"] / o["prefill"] for o, m in zip(one, many, strict=True)]
        print(f"| {batch} | {_spread([r['step'] for r in one], 1e3)} | "
              f"{_spread([r['step'] for r in many], 1e3)} | {_spread(step_ratio, 1, 2)}x | "
              f"{_spread([r['share'] for r in many], 100, 0)} % | "
              f"{_spread([r['prefill'] for r in one], 1e3, 0)} | "
              f"{_spread([r['prefill'] for r in many], 1e3, 0)} | "
              f"{_spread(prefill_ratio, 1, 2)}x |")
    return 0
