"""Start a real `pdserve router` process for the router's integration tests.

    router = start_router(model_dir, prefill=[p.address], decode=[d.address])
    client = openai.OpenAI(base_url=router.base_url, api_key="x")
    ...
    router.terminate()

Ports are picked by the OS (`--port 0 --grpc-port 0`) and read from the
router's `--ready-file`; the router's log is kept and its tail added to
failure messages.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.integration.pods import REPO_ROOT


@dataclass
class RouterProcess:
    process: subprocess.Popen
    log_path: Path
    http_port: int
    grpc_port: int
    scheme: str = "http"  # "https" with --tls-cert-file

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.http_port}/v1"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def url(self, path: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.http_port}{path}"

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def metric(self, name: str, **labels: str) -> float:
        """A sample from /metrics (0 when absent)."""
        text = urllib.request.urlopen(self.url("/metrics"), timeout=10).read().decode()
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                         if labels else "")
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def terminate(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise RuntimeError(f"router ignored SIGTERM; log:\n{self.log_tail()}") from None


def start_router(model_dir: str | Path, *, timeout: float = 60.0, **flags) -> RouterProcess:
    """`pdserve router` with `flags` (lists joined with commas; True / False:
    `--flag` / `--no-flag`) on loopback."""
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-router-"))
    ready, log_path = workdir / "ready.json", workdir / "router.log"
    args = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", "0",
            "--grpc-port", "0", "--ready-file", str(ready), "--served-model-name", "tiny",
            "--load-poll-interval", "0.2"]
    for key, value in flags.items():
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(f"--{'' if value else 'no-'}{key.replace('_', '-')}")
            continue
        args += [f"--{key.replace('_', '-')}",
                 ",".join(value) if isinstance(value, (list, tuple)) else str(value)]
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen([sys.executable, "-m", "pdserve", "router", *args],
                               stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"router did not start; log:\n{log_path.read_text()[-6000:]}")
        time.sleep(0.05)
    ports = json.loads(ready.read_text())
    return RouterProcess(process, log_path, ports["http"], ports["grpc"],
                         "https" if flags.get("tls_cert_file") else "http")


def wait_ready(router: RouterProcess, timeout: float = 30.0, context=None) -> None:
    """Until /ready answers 200 (every configured role has a healthy pod);
    `context`: the ssl.SSLContext that trusts an HTTPS router's certificate."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if urllib.request.urlopen(router.url("/ready"), timeout=5,
                                      context=context).status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"router not ready in {timeout}s; log:\n{router.log_tail()}")
        time.sleep(0.1)
