"""Conditional disaggregation end to end: real prefill and decode pods and a
real `pdserve router` on loopback, driven by the openai client.

The prefill pod computes 16 tokens per step, so a burst of ~900-token
prompts keeps it busy for a while. Short prompts sent meanwhile, all at once:

* with `--local-prefill-max-tokens 256`, go to the decode pod with
  remote_prefill=false: the router counts them, the decode pod looks their
  prompt blocks up in its prefix cache, and the prefill pod sees only the
  long prompts;
* with the rule off, take the P/D path (nothing counted, the prefill pod
  computes every prompt; the decode pod's reservations hold what its
  prefix cache has of them, the cache-miss-only transfer);
* either way every output (short and long, greedy, float32) equals the
  undisturbed run: each request alone on an in-process engine of the same
  checkpoint. (Not through these pods: the decode pod's prefix cache would
  then hold the long prompts, whose KV it caches as it arrives, and the
  router, which learns that from the pod's cache events, would rightly
  prefill a mostly cached long prompt on the decode pod too.)

With `--local-prefill-below 64`, a prompt of fewer new tokens goes local
however idle the prefill pod is: a short one by the router's rule, and a
long one whose prefix the decode pod caches by the router's prefix index or
by the decode pod's own answer to the reservation (tokens instead of
Reserved).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.integration.pods import start_pods
from tests.router.router_process import RouterProcess, start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_LONG = 8
NUM_SHORT = 5
MAX_TOKENS = 8
TTFT_COUNT = "pdserve_time_to_first_token_seconds_count"
LOOKUPS = "pdserve_prefix_cache_queries_total"


def _prompt(seed: int, low: int, high: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1100) for _ in range(rng.randrange(low, high))]


LONG = [_prompt(seed, 850, 950) for seed in range(NUM_LONG)]
SHORT = [_prompt(100 + seed, 20, 40) for seed in range(NUM_SHORT)]


@pytest.fixture(scope="module")
def pods(tiny_model_dir) -> Iterator[dict]:
    started = start_pods({
        "prefill": ("prefill", {"block_size": 16, "num_blocks": 1024,
                                "max_num_batched_tokens": 16, "no_prefix_cache": True}),
        # the prefix cache on, so the decode pod counts the prompt blocks it looks up
        "decode": ("decode", {"block_size": 16, "num_blocks": 1024, "prefix_cache": True,
                              "landing_memory": "256MiB"}),
    }, tiny_model_dir)
    yield started
    for pod in started.values():
        pod.terminate()


def _router(tiny_model_dir, pods, **flags) -> RouterProcess:
    # each test turns on the rules it is about (by default the idle side is on
    # behind a 2 s wait, which these short runs would meet only sometimes; the
    # within-budget rule would take prompts the decode pod caches from earlier tests,
    # and warm-ups would reach the prefill pod, whose requests the tests count)
    flags = {"local_prefill_max_tokens": 0, "local_prefill_min_wait": 0,
             "local_prefill_within_budget": False, "local_prefill_warm": False, **flags}
    router = start_router(tiny_model_dir, prefill=[pods["prefill"].address],
                          decode=[pods["decode"].address], log_level="DEBUG", **flags)
    wait_ready(router)
    return router


def _complete(router: RouterProcess, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=120)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
    return reply.choices[0].text


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir) -> tuple[list[str], list[str]]:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), dtype="float32",
                                    num_blocks=256))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return ([engine.generate([p], greedy)[0].text for p in LONG],
            [engine.generate([p], greedy)[0].text for p in SHORT])


def _all_at_once(router: RouterProcess, prompts: list[list[int]]
                 ) -> tuple[list[threading.Thread], list[object]]:
    """Start one client thread per prompt; returns (the threads, their results:
    each the text or the exception, filled in as they finish)."""
    results: list[object] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = _complete(router, prompts[i])
        except Exception as exc:  # noqa: BLE001 - the test looks at each
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    return threads, results


def _while_prefill_is_busy(router: RouterProcess, pods) -> tuple[list[object], list[object]]:
    """Send the long prompts at once, and once the prefill pod has one of
    them (its prefill takes seconds at 16 tokens per step), the short ones
    at once. Returns (long results, short results)."""
    long_threads, longs = _all_at_once(router, LONG)
    prefill = pods["prefill"].address
    deadline = time.monotonic() + 30
    while router.metric("pdserve_router_queue_dispatched_tokens", pod=prefill) < 850:
        assert time.monotonic() < deadline, "the long prompts never reached the prefill pod"
        time.sleep(0.02)
    short_threads, shorts = _all_at_once(router, SHORT)
    for thread in long_threads + short_threads:
        thread.join(240)
    return longs, shorts


def test_short_prompts_are_prefilled_on_the_decode_pod_while_prefill_is_busy(
        tiny_model_dir, pods, undisturbed):
    # room for every short prompt computing on the decode pod at once
    router = _router(tiny_model_dir, pods, local_prefill_max_tokens=256)
    decode, prefill = pods["decode"], pods["prefill"]
    try:
        decode_before = decode.metric_value(LOOKUPS, role="decode")
        prefill_before = prefill.metric_value(TTFT_COUNT, role="prefill")
        longs, shorts = _while_prefill_is_busy(router, pods)
        log = router.log_tail(200_000)
        assert (longs, shorts) == undisturbed, log[-4000:]
        assert router.metric("pdserve_router_local_prefills_total") == NUM_SHORT
        # each short prompt has at least one full 16-token block
        assert decode.metric_value(LOOKUPS, role="decode") - decode_before >= NUM_SHORT
        assert prefill.metric_value(TTFT_COUNT, role="prefill") - prefill_before == NUM_LONG
        assert log.count("prefills its") == NUM_SHORT
        assert "moves to a new pod pair" not in log
    finally:
        router.terminate()


def test_with_the_rule_off_nothing_is_prefilled_locally(tiny_model_dir, pods, undisturbed):
    router = _router(tiny_model_dir, pods, local_prefill_max_tokens=0)
    prefill = pods["prefill"]
    try:
        prefill_before = prefill.metric_value(TTFT_COUNT, role="prefill")
        longs, shorts = _while_prefill_is_busy(router, pods)
        assert (longs, shorts) == undisturbed
        assert router.metric("pdserve_router_local_prefills_total") == 0
        assert (prefill.metric_value(TTFT_COUNT, role="prefill") - prefill_before
                == NUM_LONG + NUM_SHORT)
    finally:
        router.terminate()


def test_below_the_threshold_prompts_go_local_also_after_a_cached_prefix(tiny_model_dir, pods):
    short = _prompt(500, 20, 21)
    base = _prompt(501, 100, 101)
    follow = base + _prompt(502, 10, 11)  # 110 tokens, 96 of them in whole blocks of base
    reference = _router(tiny_model_dir, pods, local_prefill_max_tokens=0)
    try:
        # the P/D path; the decode pod's prefix cache keeps base's blocks
        expected = [_complete(reference, p) for p in (short, base, follow)]
    finally:
        reference.terminate()
    router = _router(tiny_model_dir, pods, local_prefill_below=64)
    prefill = pods["prefill"]
    try:
        before = prefill.metric_value(TTFT_COUNT, role="prefill")
        assert _complete(router, short) == expected[0]  # 20 new tokens: the router's rule
        assert router.metric("pdserve_router_local_prefills_total") == 1
        # 110 tokens to the router, 14 new after the decode pod's cached 96: its answer
        assert _complete(router, follow) == expected[2]
        assert router.metric("pdserve_router_local_prefills_total") == 2
        assert prefill.metric_value(TTFT_COUNT, role="prefill") == before
        _complete(router, _prompt(504, 100, 101))  # nothing cached: the P/D path
        assert prefill.metric_value(TTFT_COUNT, role="prefill") == before + 1
        assert router.metric("pdserve_router_local_prefills_total") == 2
        assert "moves to a new pod pair" not in router.log_tail(200_000)
    finally:
        router.terminate()
