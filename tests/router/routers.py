"""Start `pdserve router` as a real subprocess for tests (used by the routing
integration tests and the router benchmark).

    router = start_router(model_dir, prefill=[...], decode=[...], redis_url=...)
    ... HTTP on router.base_url ...
    router.terminate()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.redis_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RouterProcess:
    process: subprocess.Popen
    port: int
    grpc_port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def complete(self, prompt: str, *, session: str | None = None, max_tokens: int = 2,
                 timeout: float = 30.0) -> dict:
        """One non-streaming /v1/completions call; raises with the router log on failure."""
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        headers = {"Content-Type": "application/json"}
        if session is not None:
            headers["x-session-id"] = session
        request = urllib.request.Request(f"{self.base_url}/v1/completions", data=body,
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"router answered {exc.code}: {exc.read()!r}\nlog tail:\n"
                                 f"{self.log_tail()}") from None

    def healthy_pods(self) -> dict[str, int]:
        """The router's own view: healthy pods per role, from GET /ready."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/ready", timeout=5) as response:
                return json.loads(response.read())["healthy_pods"]
        except urllib.error.HTTPError as exc:  # 503 (not ready) carries the counts too
            return json.loads(exc.read())["healthy_pods"]

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_router(model_dir: str | Path, *, prefill: list[str] = (), decode: list[str] = (),
                 colocated: list[str] = (), redis_url: str | None = None,
                 poll_interval: float = 0.2, timeout: float = 60.0,
                 extra: list[str] = ()) -> RouterProcess:
    """Start a router on free ports and wait until /ready answers 200."""
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve", "router", "--model", str(model_dir),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", str(grpc_port), "--load-poll-interval", str(poll_interval), *extra]
    for flag, addresses in (("--prefill", prefill), ("--decode", decode),
                            ("--colocated", colocated)):
        if addresses:
            cmd += [flag, ",".join(addresses)]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    log_path = Path(tempfile.mkdtemp(prefix="pdserve-router-")) / "router.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                   cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    router = RouterProcess(process, port, grpc_port, log_path)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"router exited with {process.returncode}:\n{router.log_tail()}")
        try:
            with urllib.request.urlopen(f"{router.base_url}/ready", timeout=2) as response:
                if response.status == 200:
                    return router
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            router.terminate()
            raise TimeoutError(f"router not ready within {timeout}s:\n{router.log_tail()}")
        time.sleep(0.1)
