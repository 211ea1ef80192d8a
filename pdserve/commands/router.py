"""`pdserve router`: the OpenAI-compatible front door (HTTP + gRPC) over
prefill/decode (and colocated) pods. Flags become a `RouterConfig`; the
environment is read here only (PDSERVE_API_KEY; PDSERVE_POD_TOKEN in
_security_flags)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
from pathlib import Path

from pdserve.commands._cpus import add_pinning_arguments, pin_process
from router.routing.split_prefill import SplitSettings
from router.settings import ROUTER_ADMISSION, ROUTER_FLOW, ROUTER_LOCAL_PREFILL

HELP = "Run the router: OpenAI-compatible HTTP + gRPC API over prefill/decode pods."


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _tokens_or_auto(value: str) -> int | None:
    """`--split-prefill-min-tokens`: a token count, or `auto` (None)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a token count or 'auto', got {value!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model directory (tokenizer, config.json), a .gguf file, or a "
                             "model name (smollm2-135m-instruct, tiny, base)")
    parser.add_argument("--served-model-name", default="",
                        help="name clients use in 'model' (default: the directory name)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port)")
    parser.add_argument("--grpc-port", type=int, default=50050, help="gRPC port (0 = any)")
    parser.add_argument("--prefill", type=_addresses, default=(), metavar="ADDR,...")
    parser.add_argument("--decode", type=_addresses, default=(), metavar="ADDR,...")
    parser.add_argument("--colocated", type=_addresses, default=(), metavar="ADDR,...")
    parser.add_argument("--redis-url", default=None,
                        help="pod registry and shared session map (redis://host:port/db)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY)")
    parser.add_argument("--api-keys-file", default=None, metavar="PATH",
                        help="named API keys with optional limits, one per line: 'NAME KEY "
                             "[max_concurrent=N] [tokens_per_minute=N]'; reloaded when the "
                             "file changes (default: $PDSERVE_API_KEYS_FILE; docs/router.md)")
    parser.add_argument("--session-epsilon", type=float, default=0.25,
                        help="a session moves off its pod above (1 + eps) x average load")
    parser.add_argument("--load-poll-interval", type=float, default=0.5, metavar="SECONDS",
                        help="how often pods are polled (pods without a live load stream) and "
                             "how often a pod's stream may report a change (default 0.5)")
    parser.add_argument("--load-reports", choices=("push", "poll"), default="push",
                        help="push: each pod streams its load on change and a heartbeat "
                             "every 2 s, health checked every 10 s; poll: GetLoad and a "
                             "health check from every pod every interval (default push)")
    parser.add_argument("--registry-absent-grace", type=float, default=10.0, metavar="SECONDS",
                        help="a pod missing from the Redis registry but still answering its "
                             "health polls stays routable this long (default 10)")
    flow, admission, local = ROUTER_FLOW, ROUTER_ADMISSION, ROUTER_LOCAL_PREFILL
    split = SplitSettings()
    parser.add_argument("--max-prefill-retries", type=int, default=flow.max_prefill_retries)
    parser.add_argument("--max-migrations", type=int, default=flow.max_migrations,
                        help="moves to a new pod pair per request after decode pods fail")
    parser.add_argument("--request-timeout", type=float, default=flow.request_timeout,
                        metavar="SECONDS")
    parser.add_argument("--trace-history", type=int, default=flow.trace_history, metavar="N",
                        help="finished requests whose timelines GET /debug/requests/{id} and "
                             "pdserve trace show (default %(default)s, 0 = off)")
    from telemetry.tracing import add_flags
    add_flags(parser)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context limit (default: max_position_embeddings in config.json)")
    parser.add_argument("--prefill-dispatch-tokens", type=int, default=admission.dispatch_tokens,
                        metavar="TOKENS",
                        help="prompt tokens the router lets be outstanding at one prefill "
                             "pod; later requests wait in the router's queue, without a "
                             "decode reservation (0 = no queue; default %(default)s)")
    parser.add_argument("--prefill-dispatch-seconds", type=float,
                        default=admission.dispatch_seconds, metavar="SECONDS",
                        help="behind the prompt a prefill pod computes, one more prompt may "
                             "wait there, and more only within this much work at the pod's "
                             "learnt prefill rate or within 256 tokens: a pod that runs its "
                             "queue in one batch gives every prompt in it its first token at the "
                             "batch's end, so the rest wait in the router in expected-finish "
                             "order instead (0 = tokens only; default %(default)g)")
    parser.add_argument("--max-queue-wait", type=float, default=admission.max_queue_wait,
                        metavar="SECONDS",
                        help="refuse a new request with 429 when its estimated wait until "
                             "its prompt is computed (the prompts ahead of it at a prefill pod, "
                             "or at every colocated pod, and its own) is above this "
                             "(default %(default)g)")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=local.max_tokens,
                        metavar="TOKENS",
                        help="the idle side: a decode pod with spare capacity prefills prompts "
                             "of at most this many new tokens itself while the prefill path is "
                             "the bottleneck (default %(default)s; 0 = never; docs/router.md, "
                             "\"Use the idle side\")")
    parser.add_argument("--local-prefill-queue-ratio", type=float, default=local.queue_ratio,
                        metavar="R",
                        help="... when the prefill path has at least R x the prompt's new "
                             "tokens queued ahead of it (default %(default)g)")
    parser.add_argument("--local-prefill-min-wait", type=float, default=local.min_wait,
                        metavar="SECONDS",
                        help="... and those tokens are at least this many seconds of work at "
                             "the prefill pod's learnt rate, so the decode pod's running batch "
                             "pays for a prompt only when it would otherwise wait that long "
                             "(default %(default)g; 0: the tokens alone decide)")
    parser.add_argument("--split-prefill-min-tokens", type=_tokens_or_auto,
                        default=split.min_tokens,
                        metavar="TOKENS",
                        help="one prompt on both pods: a context with at least this many tokens "
                             "not cached at its prefill pod is split when its decode pod has no "
                             "queue, the prefill pod "
                             "computing the head and the decode pod the tail behind it "
                             "(0 = never; default auto: 256 onto a decode pod on CPU, never "
                             "onto one on a GPU; docs/router.md, \"Split prefill\")")
    parser.add_argument("--split-prefill-head-share", type=float, default=split.head_share,
                        metavar="F",
                        help="... the head's share of the uncached tokens (after the prefill "
                             "pod's cached prefix, which the head keeps) on an idle decode pod "
                             "(default %(default)g: the tail attends over the head, so costs more "
                             "per token)")
    parser.add_argument("--split-prefill-busy-head-share", type=float,
                        default=split.busy_head_share,
                        metavar="F",
                        help="... the head's share on a decode pod with a running batch, "
                             "whose tail shares its cores with the decode steps "
                             "(default %(default)g)")
    parser.add_argument("--split-prefill-max-running", type=int, default=split.max_running,
                        metavar="N",
                        help="... and never onto a decode pod running more than N sequences: "
                             "there the tail only slows the batch (default %(default)s)")
    parser.add_argument("--local-prefill-below", type=int, default=local.below, metavar="TOKENS",
                        help="conditional disaggregation: a prompt with fewer new tokens "
                             "than this (after the decode pod's cached prefix) is prefilled "
                             "on the decode pod, no transfer (default %(default)s; 0 = off)")
    # where a turn's history is kept (docs/routing.md, "Next turns on the decode pod")
    switches = {
        "--local-prefill-within-budget": (
            local.within_budget,
            "a decode pod that caches more of a prompt than its prefill pod (a next turn's "
            "history, with the answer it generated) computes the rest itself when that fits "
            "its next step's inter-token budget: the history's blocks are cache hits, not "
            "computed again"),
        "--local-prefill-warm": (
            local.warm,
            "... and a turn a decode pod computed that way (or by --local-prefill-below) is "
            "computed again in the background on its prefill pod while that pod is idle, so "
            "the prefill pod's cache keeps the conversation for turns that take the P/D path"),
        "--warm-session-answers": (
            local.warm_answers,
            "after a P/D turn of a request with a session id (OpenAI's `user`, or "
            "x-session-id), its prefill pod computes the answer in the background while "
            "idle, so the next turn finds its whole history cached there"),
    }
    for flag, (default, text) in switches.items():
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                            help=f"{text} (default {'on' if default else 'off'}; "
                                 "docs/routing.md)")
    parser.add_argument("--routing-policy", default="first-tokens",
                        choices=("first-tokens", "session-sticky", "cache-aware", "round-robin"),
                        help="where a request no session mapping decides goes: rendezvous on "
                             "the session or first 64 prompt tokens (default), on the session "
                             "else the least-loaded pod, by cached prefix against load, or "
                             "round-robin (docs/routing.md)")
    parser.add_argument("--cache-aware-load-weight", type=float, default=1.0, metavar="W",
                        help="cache-aware routing: a prefill pod's queued prompt tokens count "
                             "W times against the tokens its prefix cache saves (default 1: "
                             "pods with their own compute; below 1 where pods share cores, "
                             "docs/routing.md)")
    parser.add_argument("--cache-index-blocks", type=int, default=262_144, metavar="N",
                        help="prefix index bound: block hashes kept per pod (default 262144, "
                             "about 26 MB per pod at most)")
    parser.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                        help="how long SIGTERM waits for in-flight requests")
    parser.add_argument("--workers", type=int, default=1,
                        help="router processes serving the same ports (SO_REUSEPORT); share "
                             "session moves through --redis-url (docs/router.md, Workers)")
    parser.add_argument("--relay", choices=("session", "stream"), default="session",
                        help="tokens from decode pods: one Decode.Session per pod, batched per "
                             "engine step (default), or one Decode.Generate stream per request")
    parser.add_argument("--http-header-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="close an HTTP connection whose request line and headers are "
                             "not complete this long after their first byte (default 30)")
    parser.add_argument("--http-keepalive-timeout", type=float, default=75.0, metavar="SECONDS",
                        help="close an HTTP connection that sends no request for this long "
                             "(after opening, or after its previous response; default 75)")
    parser.add_argument("--max-concurrent-per-client", type=int, default=0, metavar="N",
                        help="generation requests in flight per client (its API key, else its "
                             "address); more get 429 (default 0 = no limit)")
    parser.add_argument("--ready-file", default=None, metavar="PATH",
                        help='written once serving: {"http": port, "grpc": port}')
    parser.add_argument("--tool-call-parser", default="auto",
                        choices=("auto", "llama3_json", "hermes"),
                        help="how tool calls are read from chat replies: llama3_json (Llama "
                             "3.x JSON), hermes (<tool_call> tags: Hermes, Qwen), auto (from "
                             "the chat template; tool requests get a 400 if it shows neither)")
    parser.add_argument("--log-level", default="INFO")
    add_pinning_arguments(parser, threads=False)
    from pdserve.commands._security_flags import add_router_security_arguments

    add_router_security_arguments(parser)


def config_from_args(args: argparse.Namespace):
    from pdserve.commands._security_flags import (
        router_pod_security_from_args,
        router_tls_from_args,
    )
    from router.config import RouterConfig
    from router.settings import AdmissionSettings, FlowSettings, LocalPrefillSettings

    return RouterConfig(
        model_dir=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        redis_url=args.redis_url,
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY") or None,
        api_keys_file=args.api_keys_file or os.environ.get("PDSERVE_API_KEYS_FILE") or None,
        session_epsilon=args.session_epsilon,
        load_poll_interval=args.load_poll_interval,
        load_reports=args.load_reports,
        registry_absent_grace=args.registry_absent_grace,
        flow=FlowSettings(max_prefill_retries=args.max_prefill_retries,
                          max_migrations=args.max_migrations,
                          request_timeout=args.request_timeout,
                          trace_history=args.trace_history),
        max_model_len=args.max_model_len,
        shutdown_grace=args.shutdown_grace,
        admission=AdmissionSettings(dispatch_tokens=args.prefill_dispatch_tokens,
                                    dispatch_seconds=args.prefill_dispatch_seconds,
                                    max_queue_wait=args.max_queue_wait),
        relay=args.relay,
        workers=args.workers,
        local_prefill=LocalPrefillSettings(max_tokens=args.local_prefill_max_tokens,
                                           queue_ratio=args.local_prefill_queue_ratio,
                                           below=args.local_prefill_below,
                                           within_budget=args.local_prefill_within_budget,
                                           warm=args.local_prefill_warm,
                                           warm_answers=args.warm_session_answers,
                                           min_wait=args.local_prefill_min_wait),
        split_prefill=SplitSettings(min_tokens=args.split_prefill_min_tokens,
                                    head_share=args.split_prefill_head_share,
                                    busy_head_share=args.split_prefill_busy_head_share,
                                    max_running=args.split_prefill_max_running),
        tls=router_tls_from_args(args),
        pod_security=router_pod_security_from_args(args),
        routing_policy=args.routing_policy,
        cache_index_blocks=args.cache_index_blocks,
        cache_aware_load_weight=args.cache_aware_load_weight,
        http_header_timeout=args.http_header_timeout,
        http_keepalive_timeout=args.http_keepalive_timeout,
        max_concurrent_per_client=args.max_concurrent_per_client,
        tool_call_parser=args.tool_call_parser,
    )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.commands._model_arg import resolve_model_arg
    from router.server import RouterServer

    pin_process(args.cpus, torch_threads=False)
    resolve_model_arg(args, "router")
    try:
        config = config_from_args(args)
        if config.api_keys_file is not None:
            from router.api_keys import read_keys
            read_keys(config.api_keys_file)  # a bad file stops the start, naming the line
    except ValueError as exc:
        logging.getLogger("pdserve.router").error("bad router flags: %s", exc)
        return 2

    def write_ready_file(http_port: int, grpc_port: int) -> None:
        if args.ready_file:
            # write then rename, so a reader never sees half a file
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(json.dumps({"http": http_port, "grpc": grpc_port}))
            tmp.replace(args.ready_file)

    from telemetry import tracing
    setup_tracing = functools.partial(
        tracing.setup, tracing.config_from_args(args), role="router",
        address=f"{args.host}:{args.port}", model=config.served_model_name or str(args.model))
    if config.workers > 1:  # each worker sets up its own, after the spawn
        return _serve_workers(config, args.log_level, write_ready_file, setup_tracing)
    setup_tracing()
    asyncio.run(RouterServer(config).run_until_signal(
        lambda server: write_ready_file(server.http_port, server.grpc_port)))
    return 0


def _serve_workers(config, log_level: str, on_ready, setup_tracing) -> int:
    """Several worker processes (router/workers.py). prometheus_client's
    multiprocess mode is switched on here, through its environment variable,
    before any worker imports it; the directory lives as long as this run."""
    import dataclasses
    import shutil
    import tempfile

    from router.workers import serve_workers

    log = logging.getLogger("pdserve.router")
    if config.redis_url is None:
        log.warning("%d router workers without --redis-url: each keeps its own session map, "
                    "so a session moved off an overloaded pod by one worker may be routed "
                    "by another to its first-ranked pod (docs/router.md, Workers)",
                    config.workers)
    metrics_dir = tempfile.mkdtemp(prefix="pdserve-router-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        return serve_workers(dataclasses.replace(config, metrics_dir=metrics_dir),
                             log_level=log_level, on_ready=on_ready,
                             setup_tracing=setup_tracing)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
