"""kernels/omp_pool.py: a thread's OpenMP workers end when it releases its
pool, and the engine loop releases the pool of the thread that built the
engine (each case in a fresh process: thread counts are process-wide)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.integration.pods import REPO_ROOT

needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="/proc/self/maps names the OpenMP runtime")


def _run(script: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO_ROOT,
                         check=True, capture_output=True, text=True, timeout=300)
    return out.stdout.split()


THREADS = """
    def threads():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
"""


@needs_linux
def test_releasing_ends_the_calling_threads_workers():
    before, during, after, again, released = _run(THREADS + """
    import torch
    from kernels.omp_pool import release_this_threads_pool
    torch.set_num_threads(2)
    before = threads()
    torch.ones(1 << 22).sum()  # a parallel region: this thread's pool, one worker
    during = threads()
    released = release_this_threads_pool()
    after = threads()
    torch.ones(1 << 22).sum()  # libgomp starts a pool again when asked
    print(before, during, after, threads(), released)
    """)
    assert released == "True"
    assert int(during) == int(before) + 1
    assert int(after) == int(before)
    assert int(again) == int(during)


@needs_linux
def test_the_engine_loop_ends_the_pool_of_the_thread_that_built_the_engine(tiny_model_dir):
    """Built on this thread (its pool has a worker), stepped on the loop
    thread: starting the loop adds the loop thread and ends the worker."""
    built, started = _run(THREADS + f"""
    import torch
    torch.set_num_threads(2)
    from engine.config import EngineConfig
    from engine.engine_loop import EngineLoop
    from engine.llm_engine import LLMEngine
    from engine.metrics import PodMetrics
    engine = LLMEngine(EngineConfig(model_dir={str(tiny_model_dir)!r}, num_blocks=16))
    torch.ones(1 << 22).sum()  # this thread's pool exists, whatever loading ran
    built = threads()
    loop = EngineLoop(engine, PodMetrics.create("colocated"))
    loop.start()  # idle: the loop thread runs no parallel region yet
    print(built, threads())
    loop.stop()
    """)
    assert int(started) == int(built)  # + the loop thread - the ended worker
