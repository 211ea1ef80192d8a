"""A tensor-parallel pod goes down whole, in bounded time (DESIGN.md,
Tensor parallelism): rank 1 killed mid-generation or while idle, or stalled
in a collective, fails every pending request with an error naming why and
leaves no process; rank 0 killed takes its workers with it; `close()`
stops the workers cleanly. Real processes, gloo on CPU, the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_loop import EngineDead, EngineLoop, LoopState
from engine.llm_engine import LLMEngine
from engine.metrics import PodMetrics
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
# A dead peer fails rank 0's collective at once; detection must not wait for
# the collective timeout, so it is long here and the bound below is short.
DEATH_BOUND_S = 10.0


@pytest.fixture(autouse=True)
def one_thread_per_rank():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(model_dir: Path, **overrides) -> EngineConfig:
    fields = dict(model_dir=str(model_dir), dtype="float32", num_blocks=512, block_size=16,
                  tensor_parallel_size=2, tp_timeout_s=30.0)
    fields.update(overrides)
    return EngineConfig(**fields)


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def _fail_streams(loop: EngineLoop, engine: LLMEngine, disturb) -> tuple[list[str], float]:
    """Three long requests; once each streamed a token, `disturb(engine)`.
    Returns each stream's error text and the seconds until the last one."""
    streams = [await loop.add_request(f"r{i}", list(range(5 + i, 40 + i)), LONG)
               for i in range(3)]
    started = [asyncio.Event() for _ in streams]

    async def read(i: int) -> str:
        try:
            async for _ in streams[i]:
                started[i].set()
        except EngineDead as exc:
            return str(exc)
        return "finished"

    readers = [asyncio.create_task(read(i)) for i in range(len(streams))]
    for event in started:
        await asyncio.wait_for(event.wait(), 30)
    begin = time.monotonic()
    disturb(engine)
    errors = await asyncio.wait_for(asyncio.gather(*readers), 60)
    return errors, time.monotonic() - begin


def _run_loop(config: EngineConfig, scenario):
    engine = LLMEngine(config)
    loop = EngineLoop(engine, PodMetrics.create("colocated"))
    loop.start()
    try:
        return asyncio.run(scenario(loop, engine)), loop, engine
    finally:
        loop.stop()
        engine.close()


def test_rank_1_killed_mid_generation_fails_every_request(tiny_model_dir):
    def kill(engine):
        os.kill(engine.tp.pids[0], signal.SIGKILL)

    (errors, seconds), loop, engine = _run_loop(
        _config(tiny_model_dir),
        lambda loop, engine: _fail_streams(loop, engine, kill))
    assert seconds < DEATH_BOUND_S, seconds
    for error in errors:
        assert "TensorParallelError" in error and "tensor-parallel rank 1" in error, error
        assert "killed by SIGKILL" in error, error
    assert loop.state is LoopState.STOPPED  # DEAD, then stopped by the caller
    assert all(_gone(pid) for pid in engine.tp.pids)


def test_rank_1_killed_while_idle_takes_the_loop_down(tiny_model_dir):
    """No step runs: the watchdog wakes the loop, whose next step raises."""

    async def scenario(loop: EngineLoop, engine: LLMEngine):
        os.kill(engine.tp.pids[0], signal.SIGKILL)
        begin = time.monotonic()
        while loop.state is LoopState.RUNNING:
            assert time.monotonic() - begin < DEATH_BOUND_S
            await asyncio.sleep(0.05)
        with pytest.raises(EngineDead):
            await loop.add_request("late", [1, 2, 3], LONG)
        return loop.state

    state, _, engine = _run_loop(_config(tiny_model_dir), scenario)
    assert state is LoopState.DEAD
    assert all(_gone(pid) for pid in engine.tp.pids)


def test_a_stalled_rank_fails_its_collective_after_the_timeout(tiny_model_dir):
    """Rank 1 stopped (SIGSTOP) mid-generation: rank 0's collective times out
    after tp_timeout_s, and the pod goes down (the stopped rank killed)."""
    timeout_s = 3.0

    def stall(engine):
        os.kill(engine.tp.pids[0], signal.SIGSTOP)

    (errors, seconds), _, engine = _run_loop(
        _config(tiny_model_dir, tp_timeout_s=timeout_s),
        lambda loop, engine: _fail_streams(loop, engine, stall))
    assert timeout_s <= seconds < timeout_s + 2 * DEATH_BOUND_S, seconds
    for error in errors:
        assert "a tensor-parallel collective failed" in error, error
    assert all(_gone(pid) for pid in engine.tp.pids)


RANK_0 = textwrap.dedent("""
    import json, sys, torch
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model_dir=sys.argv[1], num_blocks=256,
                                    tensor_parallel_size=4))
    print(json.dumps(list(engine.tp.pids)), flush=True)
    engine.generate([list(range(5, 40))],
                    SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
""")


def test_workers_exit_when_rank_0_is_killed(tiny_model_dir):
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    rank_0 = subprocess.Popen([sys.executable, "-c", RANK_0, str(tiny_model_dir)],
                              stdout=subprocess.PIPE, env=env)
    try:
        pids = json.loads(rank_0.stdout.readline())
        assert len(pids) == 3 and not any(_gone(pid) for pid in pids)
        time.sleep(1.0)  # mid-generation: the workers are in the steps' collectives
        rank_0.kill()
        rank_0.wait()
        begin = time.monotonic()
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() - begin < DEATH_BOUND_S, "a worker outlived rank 0"
            time.sleep(0.05)
    finally:
        rank_0.kill()
        rank_0.wait()


def test_close_stops_the_workers_cleanly_and_the_group_can_be_joined_again(tiny_model_dir):
    for _ in range(2):  # a second pod in this process: the first left the group
        engine = LLMEngine(_config(tiny_model_dir, async_scheduling=True))
        engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
        begin = time.monotonic()
        engine.close()
        assert time.monotonic() - begin < DEATH_BOUND_S
        assert engine.tp.exit_codes == (0,)  # STOP read, not killed
        engine.close()  # idempotent
