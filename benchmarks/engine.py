"""`pdserve bench engine`: continuous batching vs one request at a time.

Same engine, same model, same prompts, in one run:

- **batched**: B requests added together; continuous batching prefills them
  in as few steps as the token budget allows and decodes them together;
- **sequential** (baseline): the same B requests run one after another, each
  alone in the engine.

Prefill tokens/s = prompt tokens / time until every request has its first
token; decode tokens/s = tokens after the first / the remaining time.
Prompts are random token ids (prefix caching off, so nothing is reused).
"""

from __future__ import annotations

import argparse
import time

HELP = "Engine throughput: continuous batching at batch 1/8/32 vs sequential requests."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base",
                        help="model dir, .gguf file or name: smollm2-135m-instruct, tiny, base")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--matmul-backend", default="auto", choices=("auto", "onednn", "torch"),
                        help="dense projections: oneDNN prepacked weights or F.linear")
    parser.add_argument("--decode-matmul", default="auto", choices=("auto", "native", "off"),
                        help="float32 projections: the native panel GEMM (auto: on AVX2 + "
                             "FMA) or the matmul backend's (off)")
    parser.add_argument("--breakdown", default="8:300",
                        help="BATCH:CONTEXT[,BATCH:CONTEXT...] decode steps to break down "
                             "(matmul / attention / other) beside the weight-read bound; "
                             "'none' to skip")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs (the eager baseline for a graphs A/B on CUDA)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="default: on for CUDA, off for CPU")


def _run(engine, prompts, params) -> tuple[float, float, int, int]:
    """Run prompts to completion together: (prefill s, decode s, prompt tokens, decode tokens)."""
    import torch

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    pending_first = set()
    for i, prompt in enumerate(prompts):
        request_id = f"bench-{time.monotonic_ns()}-{i}"
        engine.add_request(request_id, prompt, params)
        pending_first.add(request_id)
    sync()
    start = time.perf_counter()
    prefill_done = None
    decode_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in pending_first:
                pending_first.discard(out.request_id)
                decode_tokens += len(out.new_token_ids) - 1
            else:
                decode_tokens += len(out.new_token_ids)
        if prefill_done is None and not pending_first:
            sync()
            prefill_done = time.perf_counter()
    sync()
    end = time.perf_counter()
    return prefill_done - start, end - prefill_done, sum(map(len, prompts)), decode_tokens


def main(args: argparse.Namespace) -> int:
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_source import resolve_model
    from engine.sampling_params import SamplingParams

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    points = [] if args.breakdown == "none" else [
        tuple(int(v) for v in p.split(":")) for p in args.breakdown.split(",")]
    biggest = max(batch_sizes + [b for b, _ in points])
    tokens_per_seq = max([args.prompt_len + args.max_tokens] + [c + 40 for _, c in points])
    num_blocks = biggest * -(-tokens_per_seq // args.block_size) + 8
    engine = LLMEngine(EngineConfig(
        model_dir=model_dir, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_blocks=num_blocks, max_num_seqs=max(biggest, 1),
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
        matmul_backend=args.matmul_backend, decode_matmul=args.decode_matmul,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    # ignore_eos: every request decodes exactly max_tokens.
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    _run(engine, [torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()] * 2,
         params)  # warm-up
    print(f"model {model_dir} ({engine.model_config.num_hidden_layers} layers, hidden "
          f"{engine.model_config.hidden_size}), {args.device} {args.dtype}, torch threads "
          f"{torch.get_num_threads()}, prompt {args.prompt_len}, max_tokens {args.max_tokens}, "
          f"cuda graphs {'off' if engine.runner.graphs is None else 'on'}, async scheduling "
          f"{'on' if engine.config.use_async_scheduling else 'off'}")
    print("| batch | mode | prefill tok/s | decode tok/s | decode speedup vs sequential |")
    print("|---:|---|---:|---:|---:|")
    for batch in batch_sizes:
        prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(batch)]
        seq = [_run(engine, [p], params) for p in prompts]
        seq_prefill = sum(s[2] for s in seq) / sum(s[0] for s in seq)
        seq_decode = sum(s[3] for s in seq) / sum(s[1] for s in seq)
        pf_s, dec_s, pf_tok, dec_tok = _run(engine, prompts, params)
        print(f"| {batch} | sequential | {seq_prefill:.0f} | {seq_decode:.1f} | 1.00x |")
        print(f"| {batch} | batched | {pf_tok / pf_s:.0f} | {dec_tok / dec_s:.1f} | "
              f"{dec_tok / dec_s / seq_decode:.2f}x |")
    if points:
        from benchmarks import engine_breakdown

        print(f"\nDecode step breakdown (matmul backend {engine.matmul_backend.value}, "
              f"projections on {'the native GEMM' if engine.native_gemm else 'it'}):")
        rows = [engine_breakdown.measure(engine, b, c) for b, c in points]
        print(engine_breakdown.format_table(rows))
    return 0
