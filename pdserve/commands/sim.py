"""`pdserve sim`: many simulated pods in one process (sim/cluster.py;
docs/simulator.md)."""

from __future__ import annotations

import argparse
import asyncio

HELP = ("Run simulated prefill, decode and colocated pods (real gRPC services, real block "
        "pool and KV events, time from a performance profile), many per process.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pods")
    g.add_argument("--prefill", type=int, default=0, help="Simulated prefill pods.")
    g.add_argument("--decode", type=int, default=0, help="Simulated decode pods.")
    g.add_argument("--colocated", type=int, default=0, help="Simulated colocated pods.")
    g.add_argument("--model", required=True,
                   help="Model directory or name (tiny, base, ...): only its config.json is "
                        "read, for the vocabulary, context limit and KV shape.")
    g.add_argument("--served-model-name", default=None,
                   help="Model name the pods report (default: the model directory's name).")
    g.add_argument("--profile", default="cpu-base",
                   help="Performance profile: a name in sim/profiles/ (cpu-base, "
                        "h100-llama3-8b) or a JSON file (default cpu-base).")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="KV dtype, for transfer sizes and blocks per pod (default float32).")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="Context limit (default: the model's).")
    g.add_argument("--prefill-num-blocks", type=int, default=None,
                   help="KV blocks per prefill and colocated pod (default: the profile's "
                        "kv_cache_bytes).")
    g.add_argument("--decode-num-blocks", type=int, default=None,
                   help="KV blocks per decode pod (default: the profile's kv_cache_bytes).")
    g.add_argument("--prefill-block-size", type=int, default=16)
    g.add_argument("--decode-block-size", type=int, default=128)
    g.add_argument("--decode-prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="Prefix cache on simulated decode pods (on, as on real ones).")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--decode-mixed-prefill-tokens", type=int, default=64,
                   help="A decode pod's prompt tokens beside decodes (real CPU default 64).")
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="Address every pod binds.")
    s.add_argument("--advertise-host", default=None)
    s.add_argument("--redis-url", default=None,
                   help="Register every pod in Redis (one shared heartbeat).")
    s.add_argument("--grace-period", type=float, default=30.0)
    s.add_argument("--ready-file", default=None, metavar="PATH",
                   help='Write {"prefill": [addr, ...], "decode": [...], "colocated": [...]} '
                        "once every pod serves.")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="Serve every pod's metrics on one page at this port, each sample "
                        "labelled with its pod (0: a free port; the ready file names it "
                        'under "metrics"). Default: none.')
    s.add_argument("--log-level", default="WARNING",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def cluster_config_from_args(args: argparse.Namespace):  # -> SimClusterConfig
    """The validated cluster config (ValueError names a bad flag)."""
    from pathlib import Path

    from engine.model_config import ModelConfig
    from pod.config import ServerConfig
    from pod.kv_shape import KVShape
    from proto.roles import PodRole
    from sim.cluster import SimClusterConfig
    from sim.perf_model import load_profile
    from sim.pods import SimModel, SimPodSpec, blocks_for

    perf = load_profile(args.profile)
    mc = ModelConfig.from_pretrained(args.model)
    limit = mc.context_limit()[0]
    if args.max_model_len is not None and not 1 <= args.max_model_len <= limit:
        raise ValueError(f"--max-model-len must be in [1, {limit}], got {args.max_model_len}")
    model = SimModel(name=args.served_model_name or Path(args.model).name,
                     vocab_size=mc.vocab_size, max_model_len=args.max_model_len or limit,
                     kv_shape=KVShape(mc.num_hidden_layers, mc.num_key_value_heads,
                                      mc.head_dim, args.dtype))
    server = ServerConfig(host=args.host, advertise_host=args.advertise_host,
                          redis_url=args.redis_url, grace_period_s=args.grace_period)

    def spec(role: str, block_size: int, prefix_cache: bool, mixed: int) -> SimPodSpec:
        num_blocks = (args.decode_num_blocks if role == PodRole.DECODE
                      else args.prefill_num_blocks)
        if num_blocks is None:
            num_blocks = blocks_for(perf, model.kv_shape, block_size)
        return SimPodSpec(role=role, model=model, perf=perf, block_size=block_size,
                          num_blocks=num_blocks, prefix_cache=prefix_cache, server=server,
                          max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          mixed_prefill_tokens=mixed)

    return SimClusterConfig(
        prefill=args.prefill, decode=args.decode, colocated=args.colocated,
        prefill_spec=spec(PodRole.PREFILL, args.prefill_block_size, True, 0),
        decode_spec=spec(PodRole.DECODE, args.decode_block_size, args.decode_prefix_cache,
                         args.decode_mixed_prefill_tokens),
        colocated_spec=spec(PodRole.COLOCATED, args.prefill_block_size, True, 0),
        ready_file=args.ready_file, metrics_port=args.metrics_port)


async def _serve(config) -> int:
    from sim.cluster import SimCluster

    cluster = SimCluster(config)
    await cluster.start()
    return await cluster.run_until_stopped()


def main(args: argparse.Namespace) -> int:
    import sys

    from pdserve.commands._model_arg import resolve_model_arg
    from pdserve.commands._pod_flags import setup_logging

    setup_logging(args.log_level)
    resolve_model_arg(args, "sim")
    try:
        config = cluster_config_from_args(args)
    except ValueError as exc:
        print(f"pdserve sim: {exc}", file=sys.stderr, flush=True)
        return 2
    return asyncio.run(_serve(config))
