"""`pdserve generate --model DIR --prompt TEXT`: local generation, no servers.

Flags become an `EngineConfig` and a `SamplingParams`; the prompt is
tokenized with the model directory's tokenizer, run through an in-process
`LLMEngine`, and the completion text is printed. `--model tiny|base` uses the
built-in random-weight model (generated on first use).
"""

from __future__ import annotations

import argparse
import sys

HELP = "Generate text locally with the engine (no router, no pods)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model directory (HF format), a .gguf file, or a model name "
                             "(smollm2-135m-instruct, tiny, base)")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text; repeat the flag to batch several prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    parser.add_argument("--max-model-len", type=int, default=None)


def main(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_source import resolve_model
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer

    try:
        model_dir = str(resolve_model(args.model, say=lambda text: print(text, flush=True)))
        config = EngineConfig(model_dir=model_dir, dtype=args.dtype, device=args.device,
                              block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                              max_model_len=args.max_model_len)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens,
                                stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        tokenizer = Tokenizer.from_pretrained(model_dir)
        engine = LLMEngine(config)
        prompts = [tokenizer.encode(text) for text in args.prompt]
        results = engine.generate(prompts, params)
    except ValueError as exc:
        print(f"pdserve generate: {exc}", file=sys.stderr)
        return 2
    for text, result in zip(args.prompt, results, strict=True):
        if len(results) > 1:
            print(f"--- {text!r} ({result.finish_reason}, {len(result.token_ids)} tokens)")
        print(result.text)
    return 0
