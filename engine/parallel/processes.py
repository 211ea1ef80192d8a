"""Worker processes of a tensor-parallel pod, as rank 0 starts and watches
them (`engine.parallel.launch.TPLeader`): the command line, the output
copied to rank 0's stderr, and how an exit is described."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


def describe_exit(returncode: int) -> str:
    """A worker's exit status in words ("killed by SIGKILL", "exit status 1")."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def spawn(spec_json: str, fds: tuple[int, ...]) -> subprocess.Popen:
    """Start one worker with its `WorkerSpec` as JSON, handing it `fds` (its
    sockets); its output goes to a pipe (`forward_output`)."""
    root = str(Path(__file__).resolve().parents[2])  # the directory holding `engine`
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "engine.parallel.worker", spec_json],
        pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, env=env)


def forward_output(process: subprocess.Popen, rank: int) -> threading.Thread:
    """A thread copying the worker's output lines to our stderr, prefixed."""
    prefix = f"[tp rank {rank}] "

    def copy() -> None:
        for line in process.stdout:
            sys.stderr.write(prefix + line.decode(errors="replace"))
            sys.stderr.flush()
        process.stdout.close()

    thread = threading.Thread(target=copy, name=f"tp-rank{rank}-output", daemon=True)
    thread.start()
    return thread
