"""`JoinHold`, the engine loop's step hook on a decode pod: a step's start
held for a transfer about to complete, over a real `LLMEngine` on the tiny
model whose steps are slowed to a known length (so "a fraction of a step"
is measurable)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.join_hold import JoinHold
from engine.llm_engine import LLMEngine
from engine.metrics import PodMetrics
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

STEP_S = 0.2  # each step sleeps this long first
PROMPT = list(range(3, 23))
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(model_dir=str(tiny_model_dir), num_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def reference_tokens(engine_config) -> list[int]:
    return list(LLMEngine(engine_config).generate([PROMPT], GREEDY)[0].token_ids)


def _slow_engine(config: EngineConfig) -> tuple[LLMEngine, list[float]]:
    """The engine, with each step starting STEP_S late; returns when steps began."""
    engine = LLMEngine(config)
    step, starts = engine.step, []

    def slow_step():
        starts.append(time.monotonic())
        time.sleep(STEP_S)
        return step()

    engine.step = slow_step
    return engine, starts


def _serve(engine_config, next_ready, fraction, on_loop=None):
    """Run PROMPT through a loop with `JoinHold(next_ready, fraction)`;
    returns its tokens and the pod's metrics."""
    metrics = PodMetrics.create("decode")
    engine, _starts = _slow_engine(engine_config)

    async def main():
        loop = EngineLoop(engine, metrics, step_hook=JoinHold(next_ready, fraction, metrics))
        if on_loop is not None:
            on_loop(loop, asyncio.get_running_loop())
        loop.start()
        try:
            stream = await loop.add_request("bg", PROMPT, GREEDY)
            tokens = []
            async for output in stream:
                tokens.extend(output.new_token_ids)
            return tokens
        finally:
            loop.stop()

    return asyncio.run(main()), metrics


def _holds(metrics: PodMetrics) -> tuple[float, float]:
    return metrics.join_holds._value.get(), metrics.join_hold_seconds._value.get()


def test_a_transfer_due_now_holds_one_step_start_once_at_most_the_fraction(
        engine_config, reference_tokens):
    # "x" is always due and never commits: the loop holds for it once, up to
    # half a step, and never again
    tokens, metrics = _serve(engine_config, lambda: ("x", time.monotonic()), 0.5)
    assert tokens == reference_tokens  # holding changes no output
    count, seconds = _holds(metrics)
    assert count == 1
    assert 0.2 * STEP_S <= seconds <= 0.5 * STEP_S + 0.05


def test_a_transfer_not_due_within_the_fraction_is_not_waited_for(engine_config):
    _tokens, metrics = _serve(engine_config, lambda: ("x", time.monotonic() + 10 * STEP_S), 1.0)
    assert _holds(metrics) == (0, 0)


def test_zero_turns_it_off(engine_config):
    _tokens, metrics = _serve(engine_config, lambda: ("x", time.monotonic()), 0.0)
    assert _holds(metrics) == (0, 0)


def test_the_hold_ends_when_the_expected_commit_arrives(engine_config):
    # "y" becomes due after a few steps (the loop has learnt the step's
    # length); its commit, a command from another thread as the injector
    # queues it, comes 0.03 s into the hold, which then ends at once
    state = {"calls": 0, "committed": False, "ran": []}
    holder: dict = {}

    def commit(engine) -> None:
        state["ran"].append(time.monotonic())
        state["committed"] = True

    def next_ready():
        state["calls"] += 1
        if state["committed"] or state["calls"] < 6:
            return None
        if state["calls"] == 6:
            loop, event_loop = holder["loop"]
            threading.Timer(0.03, lambda: loop.submit(commit, event_loop)).start()
        return ("y", time.monotonic() + 0.03)

    tokens, metrics = _serve(engine_config, next_ready, 1.0,
                             on_loop=lambda loop, ev: holder.update(loop=(loop, ev)))
    assert len(tokens) == GREEDY.max_tokens and state["ran"]
    count, seconds = _holds(metrics)
    assert count == 1
    assert 0.02 <= seconds < 0.6 * STEP_S  # ended by the commit, not by the step-long budget


def test_the_fraction_is_checked():
    with pytest.raises(ValueError, match=r"join fraction must be in \[0, 1\] of a step, got 1.5"):
        JoinHold(lambda: None, 1.5, PodMetrics.create("decode"))
