"""`pdserve up` as a real subprocess (pdserve/commands/up.py).

Starts the whole local stack on free ports, streams a completion with the
`openai` client, sends SIGINT, then checks that every child exited and every
port is free again. A second test makes the pods fail at startup.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.redis_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the comm field may contain spaces; ppid is the 2nd field after the closing ')'
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    # a zombie still answers kill(0); it has exited
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class UpProcess:
    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", *args], cwd=REPO_ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """Read output lines until one matches `pattern` (or the process ends)."""
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip())
            match = regex.search(line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines))

    def rest(self, timeout_s: float) -> str:
        out, _ = self.proc.communicate(timeout=timeout_s)
        self.lines.extend(out.splitlines())
        return "\n".join(self.lines)


def env_with(home: Path) -> dict[str, str]:
    return {**os.environ, "PDSERVE_HOME": str(home), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def up_home(tmp_path_factory, smollm2_gguf) -> Path:
    """PDSERVE_HOME shared by the tests that run the default (real) model."""
    return tmp_path_factory.mktemp("pdserve-home")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_up_streams_a_completion_and_stops_cleanly(up_home: Path, stop_signal: int) -> None:
    import openai

    port, grpc_port = free_port(), free_port()
    up = UpProcess("--port", str(port), "--grpc-port", str(grpc_port), "--log-level", "INFO",
                   env=env_with(up_home))
    try:
        # the default model: SmolLM2-135M-Instruct, converted from its GGUF on first use
        # (into the module's home, once for both signals)
        up.wait_for(r"\[model\] smollm2-135m-instruct: ", 180)
        # --pin auto says what it chose: on two or more CPUs a core each, else shared
        if len(os.sched_getaffinity(0)) >= 2:
            up.wait_for(r"pods pinned to disjoint CPUs: prefill-0 on CPU [\d,-]+, decode-0 on "
                        r"CPU [\d,-]+ \(--pin off shares them\)", 10)
        else:
            up.wait_for(r"1 CPU for 2 pod processes: they share them", 10)
        pod_ports = [int(up.wait_for(rf"\[{i}/3\] \w+ pod ready on 127\.0\.0\.1:(\d+)", 120)[1])
                     for i in (1, 2)]
        up.wait_for(rf"\[3/3\] router ready on http://127\.0\.0\.1:{port}", 60)
        up.wait_for(r"curl http://127\.0\.0\.1:\d+/v1/chat/completions", 10)
        child_pids = children_of(up.proc.pid)
        assert len(child_pids) == 3, child_pids

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
        chunks = list(client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=32, stream=True, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        ))
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        up.proc.send_signal(stop_signal)
        output = up.rest(60)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()
    assert up.proc.returncode == 0, output
    assert "pdserve up: stopped" in output
    # child log lines are prefixed with their names
    assert re.search(r"^\[router\] ", output, re.MULTILINE), output
    assert re.search(r"^\[prefill-0\] ", output, re.MULTILINE), output
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in child_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in child_pids if pid_alive(p)] == []
    for p in (port, grpc_port, *pod_ports):
        assert port_free(p), f"port {p} still bound after pdserve up stopped"


@pytest.mark.timeout(120)
def test_up_reports_a_pod_dying_at_startup_and_exits_nonzero(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    up = UpProcess("--port", str(free_port()), "--grpc-port", str(free_port()),
                   "--model", str(tiny_model_dir), "--pod-arg=--max-num-seqs=0",
                   env=env_with(tmp_path))
    try:
        output = up.rest(100)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()
    assert up.proc.returncode == 1, output
    assert re.search(r"error: (prefill|decode)-0 exited with status \d+ .*stopping everything",
                     output), output
    assert children_of(up.proc.pid) == []


def test_up_flag_validation(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--decode", "0"], cwd=REPO_ROOT,
        env=env_with(tmp_path), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "need at least one prefill and one decode pod, or --colocated >= 1" in result.stdout


def test_up_tensor_parallel_flags() -> None:
    from pdserve.commands._up_config import UpConfig
    from pdserve.commands.up import pod_argv

    config = UpConfig(num_prefill=0, num_decode=0, num_colocated=1,
                      tensor_parallel=(("colocated", 2),))
    argv = pod_argv("colocated", Path("/m"), config, Path("/r"))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in pod_argv("prefill", Path("/m"), config, Path("/r"))
    with pytest.raises(ValueError, match="--colocated-tp must be between 1 and 64; got 0"):
        UpConfig(num_colocated=1, tensor_parallel=(("colocated", 0),))
    # prefill and decode at different sizes: each rank moves its own KV heads
    config = UpConfig(tensor_parallel=(("prefill", 2), ("decode", 4)))
    for role, size in (("prefill", "2"), ("decode", "4")):
        argv = pod_argv(role, Path("/m"), config, Path("/r"))
        assert argv[argv.index("--tensor-parallel-size") + 1] == size
