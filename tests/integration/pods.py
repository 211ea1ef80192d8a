"""Start real pod processes for integration tests (any test package may import this).

    pod = start_pod("decode", model_dir, block_size=128, transfer_timeout=2)
    stub = pdserve_pb2_grpc.DecodeStub(grpc.insecure_channel(pod.address))
    ...
    pod.terminate()

`start_pod` runs `python -m pdserve prefill|decode|serve` on loopback with
every port picked by the OS (`--port 0 --metrics-port 0 --kv-port 0`),
waits for the pod's `--ready-file` and for gRPC health SERVING, and captures
stdout/stderr to a log file whose tail is put into every failure message.
Keyword flags become command-line flags: `block_size=16` -> `--block-size 16`,
`no_prefix_cache=True` -> `--no-prefix-cache`, `False`/`None` are left out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROLES = {"prefill": "prefill", "decode": "decode", "colocated": "serve"}
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_START_TIMEOUT_S = 120.0


@dataclass
class PodProcess:
    """A running pod. `address` is its gRPC `host:port`."""

    role: str
    process: subprocess.Popen
    log_path: Path
    grpc_port: int
    metrics_port: int
    kv_port: int
    sigterm_sent: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_tail(self, num_chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError as exc:
            return f"(log {self.log_path} unreadable: {exc})"

    def alive(self) -> bool:
        return self.process.poll() is None

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful drain) and wait; returns the exit status."""
        if self.alive() and not self.sigterm_sent:
            self.sigterm()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{self.role} pod did not exit within {timeout}s of SIGTERM; "
                               f"log tail:\n{self.log_tail()}") from None

    def sigterm(self) -> None:
        """Send SIGTERM once (start the drain) without waiting."""
        self.sigterm_sent = True
        self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait(30)

    def metrics_text(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return response.read().decode()

    def metric_value(self, name: str, **labels: str) -> float:
        """The value of one sample (`name{labels}`), summed over unlisted labels."""
        total, found = 0.0, False
        for line in self.metrics_text().splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            sample, _, value = line.rpartition(" ")
            metric, _, label_text = sample.partition("{")
            if metric != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
                found = True
        if not found:
            raise KeyError(f"metric {name}{labels} not exported by the {self.role} pod")
        return total


def _flag_args(flags: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        args.extend([flag] if value is True else [flag, str(value)])
    return args


def start_pod(role: str, model_dir: str | Path, *, timeout: float = DEFAULT_START_TIMEOUT_S,
              env: dict[str, str] | None = None, **flags: Any) -> PodProcess:
    """Start a `role` pod ("prefill" | "decode" | "colocated") and wait until it serves."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    workdir = Path(tempfile.mkdtemp(prefix=f"pdserve-{role}-"))
    ready_file = workdir / "ready.json"
    log_path = workdir / "pod.log"
    base = {"model": str(model_dir), "host": "127.0.0.1", "port": 0, "metrics_port": 0,
            "ready_file": str(ready_file), "device": "cpu"}
    if role == "decode":
        base["kv_port"] = 0
    cmd = [sys.executable, "-m", "pdserve", ROLES[role], *_flag_args({**base, **flags})]
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                   cwd=REPO_ROOT, env=child_env)
    pod = PodProcess(role, process, log_path, 0, 0, 0)
    try:
        ports = _wait_ready(pod, ready_file, time.monotonic() + timeout)
    except BaseException:
        pod.kill()
        raise
    pod.grpc_port, pod.metrics_port, pod.kv_port = ports["grpc"], ports["metrics"], ports["kv"]
    # a pod serving TLS is watched on its plaintext --health-port
    _wait_serving(pod, time.monotonic() + timeout, ports.get("health", pod.grpc_port))
    return pod


def start_pods(specs: dict[str, tuple[str, dict[str, Any]]], model_dir: str | Path,
               ) -> dict[str, PodProcess]:
    """Start several pods at once (`name -> (role, flags)`), waiting for all;
    if one fails, the others are killed and the error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start_pod, role, model_dir, **flags)
                   for name, (role, flags) in specs.items()}
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        pods = {name: f.result() for name, f in futures.items() if f.exception() is None}
    if errors:
        for pod in pods.values():
            pod.kill()
        raise errors[0]
    return pods


def _wait_ready(pod: PodProcess, ready_file: Path, deadline: float) -> dict[str, int]:
    while time.monotonic() < deadline:
        if not pod.alive():
            raise RuntimeError(f"{pod.role} pod exited with {pod.process.returncode} before "
                               f"serving; command {pod.process.args}\nlog tail:\n"
                               f"{pod.log_tail()}")
        if ready_file.exists():
            return json.loads(ready_file.read_text())
        time.sleep(0.1)
    raise TimeoutError(f"{pod.role} pod wrote no ready file in time; log tail:\n{pod.log_tail()}")


def _wait_serving(pod: PodProcess, deadline: float, port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{pod.role} pod never reported SERVING; log tail:\n{pod.log_tail()}")
