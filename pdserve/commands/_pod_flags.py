"""Flags every pod command shares (`pdserve prefill|decode|serve`), and their
translation into the validated `EngineConfig` / `ServerConfig`.

Only command modules import this; services receive the config dataclasses.
This is the one place the pods' environment is read (`PDSERVE_KERNEL_BACKEND`,
the default of --kernel-backend).
Flag names are a contract with the router engineers and the Helm chart.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping

from engine.config import SCHEDULING_POLICIES, EngineConfig
from engine.prefix_wait import DEFAULT_MAX_WAIT_S
from pdserve.commands._cpus import add_pinning_arguments, pin_process
from pdserve.commands._security_flags import add_pod_security_arguments, pod_security_from_args
from pod.config import ServerConfig, parse_size

# Step token budget (docs/engine.md, Configuration: why 2,048 on CPU too).
STEP_TOKENS = 2048


def add_engine_arguments(parser: argparse.ArgumentParser, *, block_size: int,
                         prefix_cache_default: bool,
                         mixed_prefill_default: int | Mapping[str, int] = 0,
                         itl_budget_default: str = "off") -> None:
    """`mixed_prefill_default`: --mixed-prefill-tokens' default, or one per
    device ("cpu", "cuda"), picked once the device is resolved.
    `itl_budget_default`: --itl-budget-ms' ("auto" on decode pods)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, metavar="MODEL",
                   help="Hugging Face style model directory (config.json + safetensors), a "
                        ".gguf file, smollm2-135m-instruct, or the random-weight tiny/base "
                        "(docs/models.md).")
    g.add_argument("--block-size", type=int, default=block_size,
                   help=f"KV cache block size in tokens (default {block_size}).")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory", type=parse_size, default=None, metavar="SIZE",
                      help="KV cache budget, e.g. 2GiB (default: a fraction of free memory).")
    size.add_argument("--num-blocks", type=int, default=None, help="Exact number of KV blocks.")
    g.add_argument("--max-num-seqs", type=int, default=64, help="Sequences per batch.")
    g.add_argument("--max-num-batched-tokens", type=int, default=STEP_TOKENS,
                   help="Token budget of one engine step; longer prompts are prefilled in "
                        f"chunks, so it bounds a step's time (default {STEP_TOKENS}; smaller "
                        "smooths inter-token latency under continuous prompt arrivals at the "
                        "cost of TTFT; docs/engine.md, Configuration).")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="decode-first",
                   help="Who gets the step budget first: decoding requests (decode-first) "
                        "or the oldest request (fcfs).")
    g.add_argument("--prefix-wait-timeout", type=float, default=DEFAULT_MAX_WAIT_S,
                   metavar="SECONDS",
                   help="A waiting request whose next uncached prompt block a running request "
                        "is computing waits for it at most this long instead of computing "
                        "it twice (default 5; 0: off; docs/engine.md, Prefixes in flight).")
    g.add_argument("--short-prefill-tokens", type=int, default=0,
                   help="With decode-first: waiting prompts with at most this many tokens "
                        "to compute after their cached prefix go before longer prompts' "
                        "chunks, within half the step budget (default 0: off; e.g. 256 on "
                        "prefill pods that see multi-turn traffic; docs/engine.md, "
                        "Configuration).")
    if isinstance(mixed_prefill_default, Mapping):
        default_text = ", ".join(f"{n} on {d.upper()}" for d, n in mixed_prefill_default.items())
        parser.set_defaults(mixed_prefill_by_device=dict(mixed_prefill_default))
        mixed_prefill_default = None
    else:
        default_text = (f"{mixed_prefill_default}"
                        f"{': off, the whole step budget' if not mixed_prefill_default else ''}")
    g.add_argument("--mixed-prefill-tokens", type=int, default=mixed_prefill_default,
                   metavar="TOKENS",
                   help="With decode-first: a step that decodes computes at most this many "
                        "prompt tokens, so a prompt stalls the running batch in chunks of this "
                        f"size (default {default_text}; docs/engine.md, Configuration).")
    g.add_argument("--itl-budget-ms", default=itl_budget_default, metavar="MS|auto|off",
                   help="With decode-first: a step that decodes takes prompt tokens only "
                        "while its predicted time (a step-time model the pod learns from "
                        "its own steps) stays within this inter-token budget: milliseconds, "
                        "auto (1.5x the pod's own plain decode step at the step's batch and "
                        f"context) or off (default {itl_budget_default}; docs/engine.md, "
                        "ITL budget).")
    g.add_argument("--kernel-backend", choices=("auto", "triton", "torch"),
                   default=os.environ.get("PDSERVE_KERNEL_BACKEND", "auto"),
                   help="Kernels: Triton on CUDA and torch on CPU (auto), or one of them "
                        "everywhere (default: $PDSERVE_KERNEL_BACKEND, else auto).")
    g.add_argument("--matmul-backend", choices=("auto", "onednn", "torch"), default="auto",
                   help="Dense projections on CPU: oneDNN prepacked weights (auto) or F.linear.")
    g.add_argument("--decode-matmul", choices=("auto", "native", "off"), default="auto",
                   help="A float32 or bfloat16 model's dense projections on CPU, decode "
                        "and prefill rows: the native panel GEMM (auto: on AVX2 + FMA, in "
                        "place of oneDNN's copy of the weights; bfloat16 in k pairs on "
                        "AVX512-BF16) or the --matmul-backend's (off). auto leaves bfloat16 "
                        "to oneDNN on CPUs with AMX, or whose oneDNN multiplies bfloat16 "
                        "without AVX512-BF16; native takes it there too (docs/engine.md).")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="Plan and launch each engine step while the previous one computes "
                        "(default: on for CUDA, off on CPU, where it measured no gain; "
                        "docs/engine.md, Async scheduling).")
    g.add_argument("--enforce-eager", action="store_true",
                   help="Never capture CUDA graphs; run every step eagerly (graphs are "
                        "only used on CUDA; docs/engine.md, CUDA graphs).")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N",
                   help="Processes (one device each: cuda:0..N-1, or a share of --cpus) "
                        "the model is split across, rank 0 serving (default 1; "
                        "docs/tensor_parallel.md).")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="Context limit (default: the model's max_position_embeddings).")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    g.add_argument("--seed", type=int, default=0, help="Seed of the pod's sampling generator.")
    g.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction,
                   default=prefix_cache_default,
                   help="Keep finished requests' KV blocks for later prompts and publish "
                        "them to the routers (cache events); default "
                        f"{'on' if prefix_cache_default else 'off'} for this role.")
    add_pinning_arguments(parser, threads=True)


def add_server_arguments(parser: argparse.ArgumentParser, *, port: int,
                         metrics_port: int) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="Address to bind (default 0.0.0.0).")
    g.add_argument("--port", type=int, default=port, help=f"gRPC port (default {port}).")
    g.add_argument("--metrics-port", type=int, default=metrics_port,
                   help=f"Prometheus /metrics port, 0 = any free port (default {metrics_port}).")
    g.add_argument("--advertise-host", default=None,
                   help="Host peers dial (default: --host, or this machine's address).")
    g.add_argument("--redis-url", default=None,
                   help="Register this pod in Redis with a TTL heartbeat.")
    g.add_argument("--grace-period", type=float, default=30.0,
                   help="Seconds to finish in-flight requests after SIGTERM (default 30).")
    g.add_argument("--ready-file", default=None, metavar="PATH",
                   help='Write {"grpc": port, "metrics": port, "kv": port} here once serving.')
    g.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    add_pod_security_arguments(parser)
    from telemetry.tracing import add_flags
    add_flags(g)


def setup_tracing(args: argparse.Namespace, role: str) -> None:
    """OpenTelemetry for this pod, when --otlp-endpoint or OTEL_* asks (telemetry.tracing)."""
    from telemetry.tracing import config_from_args, setup
    host = args.advertise_host or args.host
    setup(config_from_args(args), role=role, address=f"{host}:{args.port}", model=args.model)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str, model_dir: str) -> str:
    """auto: the checkpoint's dtype on CUDA, float32 on CPU (CPU half math is slow)."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    from engine.model_config import ModelConfig

    return ModelConfig.from_pretrained(model_dir).torch_dtype


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    device = resolve_device(args.device)
    return EngineConfig(
        model_dir=args.model,
        dtype=resolve_dtype(args.dtype, device, args.model),
        device=device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        short_prefill_tokens=args.short_prefill_tokens,
        prefix_wait_s=args.prefix_wait_timeout,
        mixed_prefill_tokens=(args.mixed_prefill_by_device[device]
                              if args.mixed_prefill_tokens is None else args.mixed_prefill_tokens),
        itl_budget=args.itl_budget_ms,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_cache,
        seed=args.seed,
        kernel_backend=args.kernel_backend,
        matmul_backend=args.matmul_backend,
        decode_matmul=args.decode_matmul,
        async_scheduling=args.async_scheduling,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host, port=args.port, metrics_port=args.metrics_port,
        advertise_host=args.advertise_host, redis_url=args.redis_url,
        grace_period_s=args.grace_period, ready_file=args.ready_file,
        security=pod_security_from_args(args), health_port=args.health_port,
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def apply_placement(args: argparse.Namespace) -> None:
    """--cpus / --threads / --nice (pdserve/commands/_cpus.py): call once, after
    logging is set up and before the engine starts."""
    pin_process(args.cpus, args.threads, nice=args.nice)
