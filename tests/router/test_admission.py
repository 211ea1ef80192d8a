"""`PrefillAdmission`: the router's queue in front of the prefill pods (order,
dispatch budget, shedding with 429, leaving the queue, the metrics)."""

from __future__ import annotations

import asyncio

import pytest

from proto import pdserve_pb2
from router.api_error import ApiError
from router.cache_index.index import PrefixIndex, PromptBlocks
from router.generation import GenerationRequest
from router.metrics import RouterMetrics
from router.routing.admission import SHORT_BATCH_TOKENS, AdmissionSettings, PrefillAdmission
from router.routing.base import PodLoad, PodPool
from router.routing.ledger import MIN_SAMPLES, PEAK_HALF_LIFE_S, Throughput
from router.routing.local_prefill import LocalRate
from router.routing.policy import RoutingPolicy
from router.sampling import SamplingSpec
from router.sessions import InMemorySessionStore

pytestmark = pytest.mark.timeout(60)
POD = "127.0.0.1:7001"


class _ReportedPool(PodPool):
    """A pool whose pods' reports are set by the test (no polling)."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__()
        self.waiting_tokens = dict.fromkeys(addresses, 0)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def pods(self, role: str) -> list[PodLoad]:
        if role != "prefill":
            return []
        loads = []
        for address, waiting in sorted(self.waiting_tokens.items()):
            requests, tokens = self.in_flight(address)
            loads.append(PodLoad(address, "prefill", True, 1, 0, waiting, 0, 10, 10, 16, 0.0,
                                 requests, tokens))
        return loads

    def known(self, role: str) -> list[str]:
        return sorted(self.waiting_tokens) if role == "prefill" else []

    def mark_unhealthy(self, address: str, reason: str) -> None: ...


def _admission(pods=(POD,), local: LocalRate | None = None,
               **settings) -> tuple[PrefillAdmission, RouterMetrics, _ReportedPool]:
    pool = _ReportedPool(list(pods))
    metrics = RouterMetrics()
    policy = RoutingPolicy(pool, InMemorySessionStore())
    return (PrefillAdmission(pool, policy, metrics, AdmissionSettings(**settings), local=local),
            metrics, pool)


def _request(num_tokens: int, rid: str = "r") -> GenerationRequest:
    return GenerationRequest(rid, tuple(range(5, 5 + num_tokens)), SamplingSpec(max_tokens=4))


def _sample(metrics: RouterMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_requests_wait_in_order_until_the_pod_has_room(run_async):
    async def scenario():
        admission, metrics, _ = _admission(dispatch_tokens=100)
        order: list[str] = []

        async def admit(rid: str, n: int):
            slot = await admission.admit(_request(n, rid), exclude=frozenset(), timeout=10)
            order.append(rid)
            return slot

        first = await admit("a", 60)  # room: dispatched at once
        b = asyncio.create_task(admit("b", 60))
        c = asyncio.create_task(admit("c", 10))  # fits, but waits behind b (FIFO)
        await asyncio.sleep(0.05)
        assert order == ["a"]
        assert _sample(metrics, "pdserve_router_queue_requests", pod=POD) == 2
        assert _sample(metrics, "pdserve_router_queue_tokens", pod=POD) == 70
        assert _sample(metrics, "pdserve_router_queue_dispatched_tokens", pod=POD) == 60
        first.release(finished_tokens=60)
        slots = await asyncio.gather(b, c)
        assert order == ["a", "b", "c"]  # 60 + 10 <= 100: both go
        assert _sample(metrics, "pdserve_router_queue_requests", pod=POD) == 0
        assert _sample(metrics, "pdserve_router_queue_dispatched_tokens", pod=POD) == 70
        for slot in slots:
            slot.release()
            slot.release()  # a second release is a no-op
        assert _sample(metrics, "pdserve_router_queue_dispatched_tokens", pod=POD) == 0
        assert _sample(metrics, "pdserve_router_queue_wait_seconds_count") == 3

    run_async(scenario())


def test_a_prompt_above_the_budget_runs_alone_and_zero_budget_never_queues(run_async):
    async def scenario():
        admission, _, _ = _admission(dispatch_tokens=100)
        big = await admission.admit(_request(500), exclude=frozenset(), timeout=10)
        small = asyncio.create_task(admission.admit(_request(1), exclude=frozenset(), timeout=10))
        await asyncio.sleep(0.05)
        assert not small.done()
        big.release()
        (await small).release()

        unbounded, _, _ = _admission(dispatch_tokens=0)
        slots = [await unbounded.admit(_request(500), exclude=frozenset(), timeout=1)
                 for _ in range(5)]
        for slot in slots:
            slot.release()

    run_async(scenario())


async def _running_and_four_queued(admission: PrefillAdmission):
    """One 100-token prompt dispatched, and the tasks of four more queued
    behind it (at a 100-token budget)."""
    running = await admission.admit(_request(100), exclude=frozenset(), timeout=10)
    queued = [asyncio.create_task(admission.admit(_request(100, f"q{i}"),
                                                  exclude=frozenset(), timeout=10))
              for i in range(4)]
    await asyncio.sleep(0.01)
    return running, queued


def test_beyond_the_wait_limit_requests_get_429_and_others_go_on(run_async):
    async def scenario():
        admission, metrics, pool = _admission(dispatch_tokens=100, max_queue_wait=2.0)
        for _ in range(MIN_SAMPLES):  # until then the pod's rate is unknown
            warm = await admission.admit(_request(50), exclude=frozenset(), timeout=10)
            await asyncio.sleep(0.1)
            warm.release(finished_tokens=50)  # ~500 tokens/s
        rate = _sample(metrics, "pdserve_router_queue_prefill_tokens_per_second", pod=POD)
        assert 0 < rate <= 600  # 50 tokens in >= 0.1 busy seconds
        running, queued = await _running_and_four_queued(admission)
        wait = admission.estimated_wait(POD)
        assert wait == pytest.approx(500 / rate)
        # another router's traffic, seen in the pod's report, counts too
        pool.waiting_tokens[POD] = 1000
        assert admission.estimated_wait(POD) == pytest.approx(1400 / rate)
        # shed by the wait until its own prompt is computed: 1400 ahead + its 100
        assert admission.estimated_wait(POD, 100, computed=True) == pytest.approx(1500 / rate)
        with pytest.raises(ApiError) as err:
            await admission.admit(_request(100, "shed"), exclude=frozenset(), timeout=10)
        error = err.value
        assert error.status == 429 and error.code == "queue_full"
        assert error.message == (
            f"server overloaded: the prefill queue's estimated wait is {1500 / rate:.1f}s "
            f"until this prompt is computed (4 requests, 400 tokens to compute queued in the "
            f"router for prefill pod {POD}, and its own 100), above the limit --max-queue-wait "
            "2s; retry later")
        assert error.headers()["Retry-After"] == str(max(1, int(-(-(1500 / rate - 2) // 1))))
        assert _sample(metrics, "pdserve_router_queue_rejected_total") == 1
        assert _sample(metrics, "pdserve_router_queue_estimated_wait_seconds", pod=POD) > 2
        pool.waiting_tokens[POD] = 0
        running.release(finished_tokens=100)
        for task in queued:  # the ones accepted before the limit still get their turn
            slot = await task
            slot.release(finished_tokens=100)

    run_async(scenario())


def test_leaving_the_queue_or_running_out_of_time_frees_the_place(run_async):
    async def scenario():
        admission, metrics, pool = _admission(dispatch_tokens=10)
        running = await admission.admit(_request(10), exclude=frozenset(), timeout=10)
        left = asyncio.create_task(admission.admit(_request(5), exclude=frozenset(), timeout=10))
        await asyncio.sleep(0.02)
        assert pool.in_flight(POD) == (1, 5)  # a queued request counts toward routing load
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        assert pool.in_flight(POD) == (0, 0)
        with pytest.raises(ApiError) as err:
            await admission.admit(_request(5), exclude=frozenset(), timeout=0.05)
        assert err.value.status == 504
        assert "in the router's queue for prefill pod" in err.value.message
        assert _sample(metrics, "pdserve_router_queue_requests", pod=POD) == 0
        assert _sample(metrics, "pdserve_router_queue_tokens", pod=POD) == 0
        running.release()
        again = await admission.admit(_request(10), exclude=frozenset(), timeout=1)
        again.release()

    run_async(scenario())


def test_throughput_counts_busy_time_only():
    assert MIN_SAMPLES == 3
    meter = Throughput()
    assert meter.tokens_per_s is None
    meter.set_busy(True, 0.0)
    meter.finished(100, 1.0)  # 100 tokens in 1 busy second
    meter.set_busy(False, 1.0)
    meter.set_busy(True, 50.0)  # idle time between does not count
    meter.finished(100, 51.0)
    assert meter.tokens_per_s is None  # not yet MIN_SAMPLES prefills
    meter.finished(100, 52.0)
    assert meter.tokens_per_s == pytest.approx(100.0)
    meter.finished(300, 53.0)  # faster now: the estimate moves toward it
    assert 100.0 < meter.tokens_per_s < 300.0


def test_a_request_the_pod_has_room_for_is_never_shed(run_async):
    """A pod's first prefills pay for its warm-up: on a GPU the first one
    took seconds (kernel compilation) and the router learnt a rate ~20x too
    low. Requests that fit the dispatch budget go at once whatever the
    estimate; only those that would queue are shed."""
    async def scenario():
        # tokens only: with a seconds budget at this rate the 4 would queue
        admission, metrics, _ = _admission(dispatch_tokens=1000, dispatch_seconds=0,
                                           max_queue_wait=1.0)
        for _ in range(MIN_SAMPLES):  # ~20 tokens/s: a cold pod
            slot = await admission.admit(_request(2), exclude=frozenset(), timeout=10)
            await asyncio.sleep(0.1)
            slot.release(finished_tokens=2)
        rate = _sample(metrics, "pdserve_router_queue_prefill_tokens_per_second", pod=POD)
        assert 0 < rate <= 25
        # 4 x 250 tokens fill the budget: each "waits" 250 / 20 s by the estimate, yet runs
        slots = [await admission.admit(_request(250, f"r{i}"), exclude=frozenset(), timeout=1)
                 for i in range(4)]
        assert admission.estimated_wait(POD, 250) > 1.0  # the next would queue: shed
        with pytest.raises(ApiError) as err:
            await admission.admit(_request(250, "queued"), exclude=frozenset(), timeout=1)
        assert err.value.status == 429
        for slot in slots:
            slot.release(finished_tokens=250)
        assert admission.estimated_wait(POD, 250) == 0.0
        assert _sample(metrics, "pdserve_router_queue_rejected_total") == 1

    run_async(scenario())


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max queue wait must be in"):
        AdmissionSettings(max_queue_wait=0)
    with pytest.raises(ValueError, match="prefill dispatch tokens must be in"):
        AdmissionSettings(dispatch_tokens=-1)
    with pytest.raises(ValueError, match=r"prefill dispatch seconds must be in \[0, 3600\], "
                                         r"got -1"):
        AdmissionSettings(dispatch_seconds=-1)


def _learn_rate(admission: PrefillAdmission, tokens_per_s: float, run_async) -> None:
    """Let POD's throughput be known: MIN_SAMPLES prefills of 100 tokens, each
    dispatched for 100 / tokens_per_s seconds."""
    async def scenario():
        for i in range(MIN_SAMPLES):
            slot = await admission.admit(_request(100, f"warm-{i}"), exclude=frozenset(),
                                         timeout=10)
            await asyncio.sleep(100 / tokens_per_s)
            slot.release(finished_tokens=100)

    run_async(scenario())


def test_a_short_request_goes_ahead_of_a_long_one_it_would_finish_before(run_async):
    admission, _, _ = _admission(dispatch_tokens=100)
    _learn_rate(admission, 2_000.0, run_async)  # 100 tokens: 50 ms

    async def scenario():
        order: list[str] = []

        async def admit(rid: str, n: int):
            slot = await admission.admit(_request(n, rid), exclude=frozenset(), timeout=10)
            order.append(rid)
            return slot

        running = await admit("running", 100)
        long = asyncio.create_task(admit("long", 1_000))  # 0.5 s of work
        await asyncio.sleep(0.05)
        short = asyncio.create_task(admit("short", 10))  # 5 ms: done long before "long"
        await asyncio.sleep(0.05)
        assert order == ["running"]
        running.release(finished_tokens=100)
        (await short).release(finished_tokens=10)
        (await long).release(finished_tokens=1_000)
        assert order == ["running", "short", "long"]

        # a short request arriving after the long one's own service time waits its turn
        running = await admit("running-2", 100)
        long = asyncio.create_task(admit("long-2", 100))  # 50 ms of work
        await asyncio.sleep(0.2)
        late = asyncio.create_task(admit("late", 10))
        await asyncio.sleep(0.02)
        running.release(finished_tokens=100)
        (await long).release(finished_tokens=100)
        (await late).release(finished_tokens=10)
        assert order[-3:] == ["running-2", "long-2", "late"]

    run_async(scenario())


def test_a_prefix_the_pod_is_known_to_hold_is_not_counted_as_work(run_async):
    """With the pods' cache events (router/cache_index), a request counts the
    tokens the pod will compute: a turn whose history the pod holds fits
    the dispatch budget beside a long prompt, where its whole context would not."""
    pool = _ReportedPool([POD])
    metrics = RouterMetrics()
    index = PrefixIndex()
    history = list(range(5, 5 + 160))
    index.apply(pdserve_pb2.CacheEventBatch(
        address=POD, role="prefill", generation=1, block_size=16, sequence=1, snapshot=True,
        stored=PromptBlocks(history + [0]).hashes(16)))
    policy = RoutingPolicy(pool, InMemorySessionStore(), mode="cache-aware", index=index)
    admission = PrefillAdmission(pool, policy, metrics, AdmissionSettings(dispatch_tokens=200))

    async def scenario():
        other = GenerationRequest("other", tuple(range(1000, 1150)), SamplingSpec(max_tokens=4))
        running = await admission.admit(other, exclude=frozenset(), timeout=1)
        turn = GenerationRequest("turn", tuple(history + [900, 901, 902, 903]),
                                 SamplingSpec(max_tokens=4))
        slot = await admission.admit(turn, exclude=frozenset(), timeout=1)  # no wait
        assert (slot.address, slot.num_tokens) == (POD, 4)
        assert _sample(metrics, "pdserve_router_queue_dispatched_tokens", pod=POD) == 154
        slot.release(finished_tokens=4)
        running.release(finished_tokens=150)

    run_async(scenario())


def test_once_the_rate_is_known_at_most_the_dispatch_seconds_wait_behind_the_one_computing(
        run_async):
    """A pod sent its queue at once runs it as one batch and answers every
    prompt at the batch's end; once its rate is known, only
    --prefill-dispatch-seconds of work may wait at the pod behind the oldest
    dispatched prompt (the one it computes), and the rest wait here. The
    token budget still binds where the rate makes the seconds more tokens."""
    sizes = [350, 300, 400]
    unknown, _, _ = _admission(dispatch_tokens=2000, dispatch_seconds=0.3)
    assert run_async(_going_at_once(unknown, sizes)) == 2  # rate unknown: one may wait
    unknown_tokens_only, _, _ = _admission(dispatch_tokens=2000, dispatch_seconds=0)
    assert run_async(_going_at_once(unknown_tokens_only, sizes)) == 3
    timed, _, _ = _admission(dispatch_tokens=2000, dispatch_seconds=0.3)
    # 0.3 s = 600 tokens (300 on a machine twice as slow): one prompt of any size
    # may wait behind the 350 P computes (the 300), more only within 600 (300 + 400 not)
    _learn_rate(timed, 2_000.0, run_async)
    assert run_async(_going_at_once(timed, sizes)) == 2
    # (a fresh admission each time: finished prefills teach the rate)
    big, _, _ = _admission(dispatch_tokens=2000, dispatch_seconds=0.3)
    _learn_rate(big, 2_000.0, run_async)
    assert run_async(_going_at_once(big, [350, 900, 10])) == 2  # a big one waits, no more
    roomy, _, _ = _admission(dispatch_tokens=2000, dispatch_seconds=0.3)
    _learn_rate(roomy, 2_000.0, run_async)
    assert run_async(_going_at_once(roomy, [350, 100, 200, 500])) == 3  # 300 behind fit
    tokens_only, _, _ = _admission(dispatch_tokens=2000, dispatch_seconds=0)
    _learn_rate(tokens_only, 2_000.0, run_async)
    assert run_async(_going_at_once(tokens_only, sizes)) == 3
    generous, _, _ = _admission(dispatch_tokens=500, dispatch_seconds=10.0)
    _learn_rate(generous, 2_000.0, run_async)  # 10 s = 20,000 tokens: 500 binds
    assert run_async(_going_at_once(generous, sizes)) == 1


async def _going_at_once(admission: PrefillAdmission, sizes: list[int]) -> int:
    """How many of `sizes` (prompt tokens, sent at once) were dispatched at
    once; then lets them all finish."""
    slots = [await admission.admit(_request(sizes[0], "r0"), exclude=frozenset(),
                                   timeout=10)]
    tasks = [asyncio.create_task(admission.admit(_request(n, f"r{i}"),
                                                 exclude=frozenset(), timeout=10))
             for i, n in enumerate(sizes[1:], 1)]
    await asyncio.sleep(0.05)
    went = 1 + sum(task.done() for task in tasks)
    for slot in slots:
        slot.release(finished_tokens=slot.num_tokens)
    for task in tasks:  # the rest go in turn as earlier ones finish
        slot = await task
        slot.release(finished_tokens=slot.num_tokens)
    return went


def test_short_prompts_wait_at_the_pod_together_whatever_its_rate(run_async):
    """A step's fixed cost dominates short prompts: up to SHORT_BATCH_TOKENS
    wait at the pod behind the one it computes, also while its rate is
    unknown or would allow fewer (a burst of 32-token prompts went out a few
    at a time and was shed as a 30 s wait)."""
    assert SHORT_BATCH_TOKENS == 256
    burst = [350] + [32] * 12
    unknown, _, _ = _admission(dispatch_tokens=4096, dispatch_seconds=1.0)
    assert run_async(_going_at_once(unknown, burst)) == 1 + 8  # 8 x 32 = 256 behind
    slow, _, _ = _admission(dispatch_tokens=4096, dispatch_seconds=1.0)
    _learn_rate(slow, 100.0, run_async)  # 1 s = 100 tokens: the floor binds
    assert run_async(_going_at_once(slow, burst)) == 1 + 8
    fast, _, _ = _admission(dispatch_tokens=4096, dispatch_seconds=0.5)
    _learn_rate(fast, 2_000.0, run_async)  # 0.5 s = 1,000 tokens: the seconds bind
    assert run_async(_going_at_once(fast, burst)) == 1 + 12
    tight, _, _ = _admission(dispatch_tokens=350 + 64, dispatch_seconds=1.0)
    assert run_async(_going_at_once(tight, burst)) == 1 + 2  # the token budget still binds


def test_the_wait_is_estimated_at_the_pods_peak_rate_which_decays():
    meter = Throughput()
    meter.set_busy(True, 0.0)
    for t in (1.0, 2.0, 3.0):  # 100 tokens/s
        meter.finished(100, t)
    assert meter.peak_tokens_per_s(3.0) == pytest.approx(100.0)
    for t in (3.1, 3.2, 3.3, 3.4, 3.5):  # a batch served at 1,000 tokens/s
        meter.finished(100, t)
    peak = meter.peak_tokens_per_s(3.5)
    assert peak == pytest.approx(meter.tokens_per_s)
    for t in (4.5, 5.5, 6.5, 7.5, 8.5, 9.5):  # singles again: the rate falls, not the peak
        meter.finished(100, t)
    assert meter.tokens_per_s < peak / 2
    assert meter.peak_tokens_per_s(9.5) == pytest.approx(peak * 0.5 ** (6 / PEAK_HALF_LIFE_S))
    later = 3.5 + 3 * PEAK_HALF_LIFE_S
    assert meter.peak_tokens_per_s(later) == pytest.approx(max(meter.tokens_per_s, peak / 8))


def test_shedding_reads_the_peak_rate_not_the_latest_singles(run_async):
    admission, metrics, _ = _admission(dispatch_tokens=100, max_queue_wait=30.0)
    _learn_rate(admission, 4_000.0, run_async)
    _learn_rate(admission, 500.0, run_async)  # the latest prefills were slower
    rate = _sample(metrics, "pdserve_router_queue_prefill_tokens_per_second", pod=POD)

    async def scenario():
        running, queued = await _running_and_four_queued(admission)
        wait = admission.estimated_wait(POD)
        assert wait < 0.75 * 500 / rate  # 500 tokens ahead, at more than the latest rate
        assert _sample(metrics, "pdserve_router_queue_estimated_wait_seconds",
                       pod=POD) == pytest.approx(wait, rel=0.01)
        running.release(finished_tokens=100)
        for task in queued:
            (await task).release(finished_tokens=100)

    run_async(scenario())


def test_a_slot_released_out_of_order_leaves_the_oldest_as_the_one_computing(run_async):
    admission, _, _ = _admission(dispatch_tokens=1000, dispatch_seconds=0.2)
    _learn_rate(admission, 2_000.0, run_async)  # 200-400 tokens may wait behind the oldest

    async def scenario():
        def admit(n: int, rid: str):
            return asyncio.create_task(admission.admit(_request(n, rid), exclude=frozenset(),
                                                       timeout=10))
        oldest = await admit(300, "oldest")
        second = await admit(150, "second")  # 150 behind
        third = admit(300, "third")  # 450 behind: waits
        await asyncio.sleep(0.05)
        assert not third.done()
        second.release(finished_tokens=150)  # done before the oldest: 300 behind it now
        (await third).release(finished_tokens=300)
        oldest.release(finished_tokens=300)

    run_async(scenario())
