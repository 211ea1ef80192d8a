"""Overload without wasted work, end to end: real prefill and decode pods and a
real `pdserve router` on loopback, driven by the openai client.

The prefill pod computes 16 tokens per step, so each ~900-token prompt takes
it many steps and a burst of them (each prompt twice) queues for 20 prompts'
compute. The decode pod's transfer timeout is derived from this machine's
speed, not fixed: 4x one prompt's measured prefill time. One transfer (its
prompt's compute, alone or beside one more) so fits well inside it, and the
burst's queue (20 prompts' compute) outlasts two of it on a fast CPU or a
slow, busy one. The module runs `alone` (after the parallel part of
`make test`): a neighbouring test's load arriving between the measurement
and a burst slowed one transfer past 4x on two workers (CI, 2026-11-29).

* with the router's admission queue, the burst waits in the router and no
  decode reservation waits behind the prefill queue: no request is
  restarted and every output equals the undisturbed (one at a time) run;
* without it (`--prefill-dispatch-tokens 0`) the burst queues at the prefill
  pod with its reservations held, and still none is restarted: the decode
  pod's transfer timeout counts from the prefill's BEGIN, not from the
  reservation (before that change this burst restarted requests, some
  until they failed after --max-migrations);
* beyond `--max-queue-wait`, new requests get 429 with the queue's length and
  the limit, the accepted ones complete, and the router keeps serving;
* the queue's metrics say what happened;
* a colocated pod (no router queue in front of it) sheds the same way:
  beyond `--max-queue-wait` of estimated wait at it, new requests get 429
  naming the pod and the limit, and the accepted ones complete unchanged.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from router.routing.ledger import MIN_SAMPLES
from tests.integration.pods import PodProcess, start_pod, start_pods
from tests.router.router_process import RouterProcess, start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(300)]

# The decode pod's transfer timeout in units of one prompt's prefill time
# (see the module docstring): the burst lasts 20 of them, > 2x this.
TIMEOUT_IN_PROMPTS = 4
MAX_TOKENS = 4
NUM_BURST = 10
RESTART = "moves to a new pod pair after 0 tokens"
# --max-queue-wait of the shedding tests. The estimate is at the pod's peak
# rate: at 0.05 s a pod fast enough (~36,000 tokens/s on these 16-token
# steps) left every queued prompt's wait under the limit, and no request got
# a 429 (6 of 34 runs, CI runs 46 and 47 among them). A burst's first
# request never waits, so some always complete.
WAIT_LIMIT = 0.01


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1100) for _ in range(rng.randrange(850, 950))]


PROMPTS = [_prompt(seed) for seed in range(NUM_BURST)]
# The burst: each prompt twice (computed twice: no prefix cache); 20
# reservations of 8 blocks fit the decode pod's 256.
BURST = PROMPTS * 2
PREFILL_FLAGS = {"block_size": 16, "num_blocks": 1024, "max_num_batched_tokens": 16,
                 "no_prefix_cache": True}


@dataclass(frozen=True)
class Measured:
    """The undisturbed (one at a time) texts of PROMPTS and what one prompt's
    prefill took at the prefill pod, on this machine, now."""

    texts: list[str]
    prompt_prefill_s: float


@pytest.fixture(scope="module")
def prefill_pod(tiny_model_dir) -> Iterator[PodProcess]:
    pod = start_pod("prefill", tiny_model_dir, **PREFILL_FLAGS)
    yield pod
    pod.terminate()


@pytest.fixture(scope="module")
def measured(tiny_model_dir, prefill_pod) -> Measured:
    """PROMPTS one at a time through a decode pod with a generous timeout; the
    prefill time is the prefill pod's own mean time to first token (nothing
    queued: arrival to the prompt computed)."""
    probe = start_pod("decode", tiny_model_dir, block_size=128, num_blocks=256,
                      transfer_timeout=120, landing_memory="256MiB")
    try:
        router = _router(tiny_model_dir, prefill_pod.address, probe.address)
        try:
            client = _client(router)
            texts = [_complete(client, prompt) for prompt in PROMPTS]
        finally:
            router.terminate()
    finally:
        probe.terminate()
    ttft = "pdserve_time_to_first_token_seconds"
    took = prefill_pod.metric_value(f"{ttft}_sum") / prefill_pod.metric_value(f"{ttft}_count")
    return Measured(texts, took)


@pytest.fixture(scope="module")
def undisturbed(measured) -> list[str]:
    return measured.texts


@pytest.fixture(scope="module")
def pods(tiny_model_dir, prefill_pod, measured) -> Iterator[dict]:
    timeout = TIMEOUT_IN_PROMPTS * measured.prompt_prefill_s
    # No prefix cache at the decode pod either: these tests measure the
    # prefill pod's queue, and a decode pod holding the module's earlier
    # bursts gives the router other ways to serve their prompts.
    decode = start_pod("decode", tiny_model_dir, block_size=128, num_blocks=256,
                       transfer_timeout=f"{timeout:.3f}", landing_memory="256MiB",
                       no_prefix_cache=True)
    yield {"prefill": prefill_pod, "decode": decode, "transfer_timeout": timeout}
    decode.terminate()


def _router(tiny_model_dir, prefill: str, decode: str, **flags) -> RouterProcess:
    """The idle side off: these tests are about the prefill queue, and a
    decode pod taking prompts from it (tests/router/test_admission_local.py,
    test_local_prefill_e2e.py) would leave the burst partly unqueued. Split
    prefill (the idle decode pod computing a prompt's tail) off too: the
    prompts that teach the router the prefill pod's rate are then computed
    there whole."""
    router = start_router(tiny_model_dir, prefill=[prefill], decode=[decode],
                          local_prefill_max_tokens=0, split_prefill_min_tokens=0, **flags)
    wait_ready(router)
    return router


def _pair(pods: dict) -> tuple[str, str]:
    return pods["prefill"].address, pods["decode"].address


def _client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, prompt: list[int]) -> str:
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
    return reply.choices[0].text


def _burst(client: openai.OpenAI, prompts: list[list[int]], *,
           spacing: float = 0.02) -> list[object]:
    """Send every prompt, `spacing` seconds apart (arrival order = prompt
    order), or all together (0); each result is the text or the exception."""
    results: list[object] = [None] * len(prompts)
    together = threading.Barrier(len(prompts)) if not spacing else None

    def one(i: int) -> None:
        if together is not None:
            together.wait(30)
        try:
            results[i] = _complete(client, prompts[i])
        except Exception as exc:  # noqa: BLE001 - the test looks at each
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
        time.sleep(spacing)
    for thread in threads:
        thread.join(240)
    return results


def test_queued_prefill_longer_than_the_transfer_timeout_is_not_restarted(
        tiny_model_dir, pods, undisturbed):
    router = _router(tiny_model_dir, *_pair(pods), prefill_dispatch_tokens=1000)
    try:
        peak = _watch_queue(router, pods["prefill"].address)
        started = time.monotonic()
        results = _burst(_client(router), BURST)
        took = time.monotonic() - started
        peak_queued = peak()
        log = router.log_tail(200_000)
        assert results == undisturbed * 2, log[-4000:]
        assert RESTART not in log
        # the burst really queued for longer than the decode pod's transfer timeout
        assert took > 2 * pods["transfer_timeout"], (took, pods["transfer_timeout"])
        assert peak_queued >= 1
        pod = pods["prefill"].address
        assert router.metric("pdserve_router_queue_wait_seconds_count") == len(BURST)
        assert router.metric("pdserve_router_queue_wait_seconds_sum") > pods["transfer_timeout"]
        assert router.metric("pdserve_router_queue_requests", pod=pod) == 0
        assert router.metric("pdserve_router_queue_dispatched_tokens", pod=pod) == 0
        assert router.metric("pdserve_router_queue_prefill_tokens_per_second", pod=pod) > 0
        assert router.metric("pdserve_router_queue_rejected_total") == 0
    finally:
        router.terminate()


def test_queued_at_the_prefill_pod_itself_is_not_restarted_either(
        tiny_model_dir, pods, undisturbed):
    # No router queue: every request reserves at once and queues at the prefill
    # pod. The decode pod's deadlines are per phase (the transfer timeout counts
    # from the prefill's BEGIN), so waiting there does not expire them.
    router = _router(tiny_model_dir, *_pair(pods), prefill_dispatch_tokens=0)
    try:
        started = time.monotonic()
        results = _burst(_client(router), BURST)
        assert time.monotonic() - started > 2 * pods["transfer_timeout"]
        log = router.log_tail(200_000)
        assert results == undisturbed * 2, log[-4000:]
        assert RESTART not in log
    finally:
        router.terminate()


def test_beyond_the_wait_limit_requests_get_429_and_the_rest_complete(
        tiny_model_dir, pods, undisturbed):
    router = _router(tiny_model_dir, *_pair(pods), prefill_dispatch_tokens=1000,
                     max_queue_wait=WAIT_LIMIT)
    try:
        client = _client(router)
        # the first prefills teach the router the pod's throughput
        for i in range(MIN_SAMPLES):
            assert _complete(client, PROMPTS[i]) == undisturbed[i]
        _shed_some(router, _burst(client, PROMPTS), undisturbed,
                   "server overloaded: the prefill queue's estimated wait is ")
        # the server keeps serving everyone else
        assert _complete(client, PROMPTS[1]) == undisturbed[1]
    finally:
        router.terminate()


@pytest.fixture(scope="module")
def colocated(tiny_model_dir) -> Iterator[dict]:
    started = start_pods({"colocated": ("colocated", {
        "block_size": 16, "num_blocks": 1024, "max_num_batched_tokens": 16,
        "no_prefix_cache": True})}, tiny_model_dir)
    yield started
    for pod in started.values():
        pod.terminate()


def test_a_colocated_pod_beyond_the_wait_limit_sheds_with_429(tiny_model_dir, colocated):
    pod = colocated["colocated"].address
    router = start_router(tiny_model_dir, colocated=[pod], max_queue_wait=WAIT_LIMIT)
    try:
        wait_ready(router)
        client = _client(router)
        # one at a time (never shed: nothing is outstanding), which also teaches
        # the router the pod's rate
        alone = [_complete(client, prompt) for prompt in PROMPTS]
        _shed_some(router, _burst(client, PROMPTS, spacing=0), alone,
                   f"server overloaded: the estimated wait at colocated pod {pod} is ")
        assert router.metric("pdserve_router_queue_prefill_tokens_per_second", pod=pod) > 0
        assert router.metric("pdserve_router_queue_dispatched_tokens", pod=pod) == 0
        assert _complete(client, PROMPTS[1]) == alone[1]  # and it keeps serving
    finally:
        router.terminate()


def _shed_some(router: RouterProcess, results: list[object], expected: list[str],
               message_start: str) -> None:
    """A burst of PROMPTS beyond --max-queue-wait WAIT_LIMIT: some got 429 with the
    wait, the limit and Retry-After, every other one its undisturbed text."""
    shed = [r for r in results if isinstance(r, openai.RateLimitError)]
    done = [(i, r) for i, r in enumerate(results) if isinstance(r, str)]
    assert len(shed) + len(done) == NUM_BURST, results
    assert shed and done
    assert all(text == expected[i] for i, text in done)
    error = shed[0]
    assert error.status_code == 429
    assert int(error.response.headers["retry-after"]) >= 1
    body = error.body
    assert body["code"] == "queue_full" and body["type"] == "overloaded_error"
    assert body["message"].startswith(message_start)
    assert "s until this prompt is computed (" in body["message"]
    assert f"above the limit --max-queue-wait {WAIT_LIMIT:g}s" in body["message"]
    assert router.metric("pdserve_router_queue_rejected_total") == len(shed)


def _watch_queue(router: RouterProcess, pod: str):
    """Sample the router's queue length in the background; returns a function
    that stops sampling and gives the largest value seen."""
    peak, stop = [0.0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], router.metric("pdserve_router_queue_requests", pod=pod))
            except OSError:
                pass
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def finish() -> float:
        stop.set()
        thread.join(5)
        return peak[0]

    return finish

