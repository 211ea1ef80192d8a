"""The child processes of `pdserve up`: how each is started, watched and
its output relayed (pdserve/commands/up.py runs the life cycle)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from router.workers import die_with_parent


class StartupError(RuntimeError):
    """A child failed to come up; the message says which and why."""


@dataclass
class Child:
    """One child process and what `up` knows about it."""

    name: str  # "prefill-0", "router", ...
    process: subprocess.Popen
    workdir: Path
    started_at: float = field(default_factory=time.monotonic)
    address: str = ""
    metrics_port: int = 0
    argv: list[str] = field(default_factory=list)  # what `spawn` ran (a restart runs it again)
    ready_file: Path | None = None  # the child writes it once it serves

    def alive(self) -> bool:
        return self.process.poll() is None


def _pump(name: str, stream) -> None:
    """Reader thread: copy a child's output to ours, one prefixed line at a time."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        sys.stdout.write(f"[{name}] {line}\n")
        sys.stdout.flush()
    stream.close()


def spawn(name: str, argv: list[str], workdir: Path, ready_file: Path | None = None) -> Child:
    """Start `python -m pdserve ARGV` in its own session with prefixed output.
    `ready_file` is the path ARGV's --ready-file names (removed first, so that its
    appearance means this process serves)."""
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True, preexec_fn=die_with_parent if sys.platform == "linux" else None,
    )
    threading.Thread(target=_pump, args=(name, process.stdout), name=f"log-{name}",
                     daemon=True).start()
    return Child(name, process, workdir, argv=list(argv), ready_file=ready_file)


# The port flags `up` passes as 0 (any free port), and the ready-file keys of the ports
# the pod then bound: a restarted pod asks for the same ones.
_PORT_FLAGS = {"--port": "grpc", "--metrics-port": "metrics", "--kv-port": "kv"}


def pin_ports(argv: list[str], ports: dict[str, int]) -> list[str]:
    """`argv` with each `--port`/`--metrics-port`/`--kv-port VALUE` set to the port the
    pod reported in its ready file (flags it does not have are left out)."""
    pinned = list(argv)
    for i, arg in enumerate(pinned[:-1]):
        key = _PORT_FLAGS.get(arg)
        if key is not None and ports.get(key):
            pinned[i + 1] = str(ports[key])
    return pinned


def check_alive(child: Child) -> None:
    if not child.alive():
        raise StartupError(f"{child.name} exited with status {child.process.returncode} "
                           "(its log is above, prefixed with its name)")
