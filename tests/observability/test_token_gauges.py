"""The pod's token gauges (engine/token_gauges.py) after known engine
activity on the tiny model: prompt tokens still to compute (less the cached
prefix), running context tokens, KV usage, and the queue wait's histogram
and sliding-window median."""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import PodMetrics
from engine.sampling_params import SamplingParams
from engine.token_gauges import WaitWindow

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
TWO_TOKENS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
ROLE = {"role": "colocated"}


class Pod:
    """A real engine stepped by the test, publishing like the engine loop."""

    def __init__(self, model_dir, **config) -> None:
        self.engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_blocks=64,
                                             block_size=16, **config))
        self.metrics = PodMetrics.create("colocated")

    def publish(self) -> None:
        self.metrics.tokens.refresh_now()
        self.metrics.publish_tokens(self.engine, self.engine.stats())

    def value(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(name, ROLE)
        assert value is not None, name
        return value

    def step_all(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()
            self.publish()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def test_waiting_running_and_kv_usage_after_steps(model_dir) -> None:
    pod = Pod(model_dir)
    pod.publish()
    assert pod.value("pdserve_prompt_tokens_waiting") == 0
    assert pod.value("pdserve_kv_cache_usage_ratio") == 0
    assert math.isnan(pod.value("pdserve_queue_wait_p50_seconds"))

    pod.engine.add_request("a", list(range(3, 43)), TWO_TOKENS)   # 40 tokens
    pod.engine.add_request("b", list(range(50, 70)), TWO_TOKENS)  # 20 tokens
    pod.publish()
    assert pod.value("pdserve_prompt_tokens_waiting") == 60
    assert pod.value("pdserve_running_context_tokens") == 0
    assert pod.value("pdserve_queue_wait_seconds_count") == 0

    pod.engine.step()  # both prompts fit one step's budget: each samples a token
    pod.publish()
    assert pod.value("pdserve_prompt_tokens_waiting") == 0
    assert pod.value("pdserve_running_context_tokens") == 41 + 21
    stats = pod.engine.stats()
    used = stats.num_total_blocks - stats.num_free_blocks
    assert used >= 3 + 2  # 41 and 21 tokens in blocks of 16
    assert pod.value("pdserve_kv_cache_usage_ratio") == pytest.approx(used / 64)
    assert pod.value("pdserve_queue_wait_seconds_count") == 2
    assert pod.value("pdserve_queue_wait_p50_seconds") >= 0

    pod.step_all()
    assert pod.value("pdserve_running_context_tokens") == 0
    assert pod.value("pdserve_queue_wait_seconds_count") == 2  # counted once each


def test_waiting_tokens_leave_out_the_cached_prefix(model_dir) -> None:
    pod = Pod(model_dir)
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16 and 8 more
    pod.engine.add_request("first", prompt, ONE_TOKEN)
    pod.step_all()
    pod.engine.add_request("again", prompt, ONE_TOKEN)
    pod.publish()
    # the two full blocks are cached; the last token is always computed
    assert pod.value("pdserve_prompt_tokens_waiting") == 40 - 32


def test_chunked_prompt_counts_its_rest_while_running(model_dir) -> None:
    pod = Pod(model_dir, max_num_batched_tokens=32, short_prefill_tokens=0)
    pod.engine.add_request("long", list(range(3, 103)), ONE_TOKEN)  # 100 tokens
    pod.engine.step()  # the first 32 tokens
    pod.publish()
    assert pod.value("pdserve_prompt_tokens_waiting") == 100 - 32
    assert pod.value("pdserve_running_context_tokens") == 100


def test_an_aborted_waiting_request_records_no_wait(model_dir) -> None:
    pod = Pod(model_dir)
    pod.engine.add_request("gone", list(range(3, 23)), ONE_TOKEN)
    pod.publish()
    assert pod.engine.abort_request("gone")
    pod.publish()
    assert pod.value("pdserve_prompt_tokens_waiting") == 0
    assert pod.value("pdserve_queue_wait_seconds_count") == 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_wait_window_median_forgets_old_samples() -> None:
    clock = Clock()
    window = WaitWindow(seconds=60, capacity=3, clock=clock)
    assert math.isnan(window.median())
    window.add(5.0)
    clock.now += 30
    window.add(1.0)
    assert window.median() == 3.0  # (1 + 5) / 2
    window.add(2.0)
    assert window.median() == 2.0
    clock.now += 31  # the 5.0 is now 61 s old
    assert window.median() == 1.5
    for wait in (7.0, 8.0, 9.0):  # capacity 3: only the newest stay
        window.add(wait)
    assert window.median() == 8.0
    clock.now += 61
    assert math.isnan(window.median())


def test_wait_window_refuses_bad_bounds() -> None:
    with pytest.raises(ValueError, match="seconds > 0 and capacity >= 1"):
        WaitWindow(seconds=0)
    with pytest.raises(ValueError, match="capacity >= 1"):
        WaitWindow(capacity=0)
