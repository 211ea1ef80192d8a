"""`pdserve up` keeps serving when a pod dies, and restarts it on the same port
(pdserve/commands/_supervisor.py); a child that keeps failing stops everything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.commands._children import Child, pin_ports
from pdserve.commands._supervisor import GiveUp, RestartPolicy, Supervisor
from tests.pdserve.test_up import REPO_ROOT, children_of, env_with
from tests.redis_server import free_port


class Output:
    """Drains a process's output on a thread (a full pipe would block `up`'s children)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip())
                self._cond.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> str:
        with self._cond:
            found = self._cond.wait_for(
                lambda: any(text in line for line in self.lines), timeout_s)
            assert found, f"no line with {text!r}; output:\n" + "\n".join(self.lines[-80:])
            return next(line for line in self.lines if text in line)

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def healthy_decode_pods(port: int) -> int:
    """The router's own view, from GET /ready (a 503 carries the counts too)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as response:
            return json.loads(response.read())["healthy_pods"]["decode"]
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())["healthy_pods"]["decode"]


def pid_of(parent: int, marker: str) -> int:
    for pid in children_of(parent):
        if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
    raise AssertionError(f"no child of {parent} with {marker!r} in its command line")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_up_keeps_serving_when_a_pod_is_killed_and_restarts_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import openai

    port, ready_file = free_port(), tmp_path / "up-ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--grpc-port",
         str(free_port()), "--model", str(tiny_model_dir), "--prefill", "1", "--decode", "2",
         "--ready-file", str(ready_file)],
        cwd=REPO_ROOT, env=env_with(tmp_path), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    out = Output(proc)
    try:
        out.wait_for("pdserve is serving", 120)  # printed after the ready file is written
        pods = {p["name"]: p for p in json.loads(ready_file.read_text())["pods"]}
        address = pods["decode-0"]["grpc"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               max_retries=0, timeout=60)

        def complete(i: int) -> None:
            result = client.completions.create(model=tiny_model_dir.name, prompt=f"n{i} go",
                                               max_tokens=4, temperature=0)
            assert result.choices[0].finish_reason in ("length", "stop")

        complete(0)
        old_pid = pid_of(proc.pid, "decode-0")
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # requests keep succeeding on the survivors while decode-0 is down and restarting
        i = 1
        while not any("decode-0 is back" in line for line in out.text().splitlines()):
            assert time.monotonic() - killed_at < 90, out.text()[-6000:]
            complete(i)
            i += 1
        assert i > 3
        back = out.wait_for("decode-0 is back", 1)
        assert f"on {address}" in back
        assert "decode-0 exited with status -9; the others keep serving, restarting it in " \
               "0.5 s" in out.text()
        assert serving(address)  # the same port serves again
        assert pid_of(proc.pid, "decode-0") != old_pid
        # ... and it serves through the router again: once the router sees both decode
        # pods, kill the other one; the restarted pod carries every request
        deadline = time.monotonic() + 30
        while healthy_decode_pods(port) < 2:
            assert time.monotonic() < deadline, "the router never saw decode-0 again"
            time.sleep(0.1)
        os.kill(pid_of(proc.pid, "decode-1"), signal.SIGKILL)
        for j in range(5):
            complete(1000 + j)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, out.text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_supervisor_backs_off_and_gives_up_on_a_child_that_keeps_failing(
    tmp_path: Path
) -> None:
    """Real processes that exit at once; the clock is passed in."""
    def start(name: str) -> Child:
        process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        return Child(name, process, tmp_path, argv=["x"])

    children = [start("prefill-0")]
    children[0].process.wait()
    messages: list[str] = []
    spawned: list[Child] = []

    def respawn(old: Child) -> Child:
        spawned.append(start(old.name))
        spawned[-1].process.wait()
        return spawned[-1]

    policy = RestartPolicy(max_restarts=2, window_s=60.0)
    supervisor = Supervisor(children, policy, respawn, lambda c: False, messages.append)
    supervisor.check(now=100.0)
    assert messages == ["prefill-0 exited with status 3; the others keep serving, restarting "
                        "it in 0.5 s (1 exit within 60 s)"]
    supervisor.check(now=100.4)  # still backing off
    assert spawned == []
    supervisor.check(now=100.5)
    assert messages[-1] == "restarting prefill-0 (restart 1)" and children == spawned
    supervisor.check(now=100.6)
    assert messages[-1].endswith("restarting it in 1.0 s (2 exits within 60 s)")
    supervisor.check(now=101.6)
    with pytest.raises(GiveUp, match=r"prefill-0 exited with status 3; it exited 3 times "
                                     r"within 60 s \(--max-restarts 2 per --restart-window\), "
                                     r"giving up"):
        supervisor.check(now=101.7)
    # exits older than the window are forgotten: the backoff starts over
    assert [policy.backoff_s(n) for n in (1, 2, 3, 5, 6, 9)] == [0.5, 1.0, 2.0, 8.0, 10.0, 10.0]


def test_restart_flags_are_validated_and_ports_pinned() -> None:
    with pytest.raises(ValueError, match=r"--max-restarts must be in 0..1000; got -1"):
        RestartPolicy(max_restarts=-1)
    argv = ["decode", "--port", "0", "--metrics-port", "0", "--kv-port", "0", "--x", "0"]
    assert pin_ports(argv, {"grpc": 5, "metrics": 6, "kv": 7}) == [
        "decode", "--port", "5", "--metrics-port", "6", "--kv-port", "7", "--x", "0"]
    assert pin_ports(["prefill", "--port", "0"], {"grpc": 5, "kv": 0}) == [
        "prefill", "--port", "5"]
