"""Processes for `pdserve bench soak` (benchmarks/soak.py): one prefill pod,
N decode pods and a router on loopback, every port fixed up front so a pod
can be stopped and started again where the router expects it.

Each child runs `python -m pdserve ...` with its log in the run's directory;
`SoakStack.restart(name, sig)` signals one pod, waits for it to exit and
starts the same command again (a new generation on the same ports).
`rss_bytes` and `kv_blocks` read what the report needs: a process's
resident memory (/proc) and a pod's free/total KV blocks (GetLoad).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.peer_servers import free_port as _free_port  # below the ephemeral range


@dataclass
class Child:
    """One process of the stack and how to start it again."""

    name: str
    argv: list[str]
    log: Path
    ready: Path | None  # pods: their --ready-file
    grpc: str  # host:port (pods: gRPC; router: its gRPC front door)
    process: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> None:
        if self.ready is not None and self.ready.exists():
            self.ready.unlink()
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pdserve", *self.argv], stdout=out,
                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float) -> None:
        assert self.process is not None and self.ready is not None
        deadline = time.monotonic() + timeout
        while not self.ready.is_file():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} failed to start:\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)


@dataclass
class SoakStack:
    children: dict[str, Child] = field(default_factory=dict)
    http_url: str = ""

    @property
    def pods(self) -> list[Child]:
        return [c for c in self.children.values() if c.ready is not None]

    def restart(self, name: str, sig: int, timeout: float = 120) -> float:
        """Signal `name`, wait for it to exit, start it again; seconds until it serves."""
        child = self.children[name]
        assert child.process is not None
        started = time.monotonic()
        child.process.send_signal(sig)
        child.process.wait(timeout)
        child.start()
        child.wait_ready(timeout)
        child.restarts += 1
        return time.monotonic() - started

    def stop(self) -> None:
        running = [c.process for c in reversed(self.children.values())
                   if c.process is not None and c.process.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_soak_stack(model: Path, workdir: Path, *, num_decode: int, pod_args: list[str],
                     router_args: list[str], timeout: float = 300) -> SoakStack:
    """Start prefill, `num_decode` decode pods and the router; return once /ready is 200."""
    stack = SoakStack()
    roles = ["prefill"] + [f"decode{i}" for i in range(num_decode)]
    for name in roles:
        role = "prefill" if name == "prefill" else "decode"
        port, ready = _free_port(), workdir / f"{name}.json"
        argv = [role, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", str(_free_port()), "--ready-file", str(ready),
                "--log-level", "WARNING", *pod_args]
        if role == "decode":
            argv += ["--kv-port", str(_free_port())]
        stack.children[name] = Child(name, argv, workdir / f"{name}.log", ready,
                                     f"127.0.0.1:{port}")
    for child in stack.children.values():
        child.start()
    try:
        for child in stack.children.values():
            child.wait_ready(timeout)
        http_port, grpc_port = _free_port(), _free_port()
        decode = ",".join(c.grpc for c in stack.pods if c.name != "prefill")
        router = Child("router", ["router", "--model", str(model), "--host", "127.0.0.1",
                                  "--port", str(http_port), "--grpc-port", str(grpc_port),
                                  "--prefill", stack.children["prefill"].grpc,
                                  "--decode", decode, "--log-level", "WARNING", *router_args],
                       workdir / "router.log", None, f"127.0.0.1:{grpc_port}")
        stack.children["router"] = router
        router.start()
        stack.http_url = f"http://127.0.0.1:{http_port}"
        wait_router_ready(stack, timeout=60)
    except BaseException:
        stack.stop()
        raise
    return stack


def wait_router_ready(stack: SoakStack, timeout: float) -> None:
    router = stack.children["router"]
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(stack.http_url + "/ready", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            assert router.process is not None
            if router.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("router not ready:\n"
                                   f"{router.log.read_text(errors='replace')[-3000:]}") from None
            time.sleep(0.1)


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def kv_blocks(child: Child) -> tuple[int, int]:
    """(free, total) KV blocks of a pod, from GetLoad."""
    import grpc

    from proto import pdserve_pb2, pdserve_pb2_grpc

    service = "Prefill" if child.name == "prefill" else "Decode"
    with grpc.insecure_channel(child.grpc) as channel:
        stub = getattr(pdserve_pb2_grpc, f"{service}Stub")(channel)
        report = stub.GetLoad(pdserve_pb2.LoadRequest(), timeout=10)
    return report.num_free_blocks, report.num_total_blocks

