"""The idle side taking a request out of the prefill queue
(`PrefillAdmission.admit(local=...)`, router.routing.local_prefill.QueuedOffer):
what a waiter offers is asked again when a local prefill frees its pod, with
the tokens still ahead of it; taken, it leaves the queue and the next waiter
may go; dispatched first, it keeps its slot. The prompts decode pods
prefill themselves count toward their local rate, which the shedding
estimate adds to the prefill pods' rate."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.api_error import ApiError
from router.routing.admission import AdmissionSlot
from router.routing.local_prefill import (
    LOCAL_RATE_WINDOW_S,
    Ahead,
    LocalChoice,
    LocalPrefill,
    LocalPrefillSettings,
    LocalRate,
)
from tests.router.test_admission import POD, _admission, _request, _sample
from tests.router.test_local_prefill import DECODE_A, _load, _Pool

OTHER = "127.0.0.1:7002"

pytestmark = pytest.mark.timeout(60)


class _Offer:
    """A QueuedOffer whose answer the test sets; records what it was asked."""

    RECHECK_S = 30.0  # only `changed` wakes the waiter here

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.waits: list[float | None] = []
        self.answer: LocalChoice | None = None
        self._changed: asyncio.Future[None] | None = None

    def offer(self, ahead: Ahead) -> LocalChoice | None:
        self.asked.append(ahead.tokens)
        self.waits.append(ahead.wait)
        return self.answer

    def changed(self) -> asyncio.Future[None]:
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def fire(self, answer: LocalChoice | None) -> None:
        self.answer = answer
        self.changed().set_result(None)


def test_a_waiter_taken_by_a_decode_pod_leaves_the_queue_and_the_next_one_goes(run_async):
    async def scenario():
        admission, metrics, _ = _admission(dispatch_tokens=100)
        running = await admission.admit(_request(90), exclude=frozenset(), timeout=10)
        offer = _Offer()
        taken = asyncio.create_task(admission.admit(_request(30, "taken"), exclude=frozenset(),
                                                    timeout=10, local=offer))
        await asyncio.sleep(0.02)
        behind = asyncio.create_task(admission.admit(_request(10, "behind"),
                                                     exclude=frozenset(), timeout=10))
        await asyncio.sleep(0.02)
        offer.fire(None)  # asked, declined: it waits on
        await asyncio.sleep(0.02)
        assert offer.asked == [90] and not taken.done()  # the prompt computing, not itself
        choice = LocalChoice(DECODE_A, 30, 90)
        offer.fire(choice)
        assert await taken is choice
        # 90 + 10 <= 100: "behind" fitted all along but waited behind "taken" (FIFO)
        slot = await asyncio.wait_for(behind, 1)
        assert isinstance(slot, AdmissionSlot)
        assert _sample(metrics, "pdserve_router_queue_requests", pod=POD) == 0
        assert _sample(metrics, "pdserve_router_queue_tokens", pod=POD) == 0
        assert _sample(metrics, "pdserve_router_queue_dispatched_tokens", pod=POD) == 100
        running.release()
        slot.release()

    run_async(scenario())


def test_a_waiter_is_offered_the_wait_of_the_tokens_ahead_once_the_rate_is_known(run_async):
    async def scenario():
        admission, _, _ = _admission(dispatch_tokens=100)
        for i in range(3):  # MIN_SAMPLES prefills of 100 tokens, ~0.05 s each
            slot = await admission.admit(_request(100, f"learn-{i}"), exclude=frozenset(),
                                         timeout=10)
            await asyncio.sleep(0.05)
            slot.release(finished_tokens=100)
        running = await admission.admit(_request(90), exclude=frozenset(), timeout=10)
        offer = _Offer()
        waiting = asyncio.create_task(admission.admit(_request(30, "w"), exclude=frozenset(),
                                                      timeout=10, local=offer))
        await asyncio.sleep(0.02)
        offer.fire(None)
        await asyncio.sleep(0.02)
        rate = admission._queues[POD].throughput.peak_tokens_per_s(time.monotonic())
        assert offer.asked == [90] and rate is not None and 300 < rate < 2100
        assert offer.waits[0] == pytest.approx(90 / rate, rel=0.05)
        ahead = admission.least_ahead(frozenset())
        assert ahead.tokens == 120 and ahead.wait == pytest.approx(120 / rate, rel=0.05)
        running.release(finished_tokens=90)
        (await waiting).release()

    run_async(scenario())


def test_a_waiter_dispatched_first_keeps_its_slot_and_one_out_of_time_gets_504(run_async):
    async def scenario():
        admission, metrics, pool = _admission(dispatch_tokens=10)
        running = await admission.admit(_request(10), exclude=frozenset(), timeout=10)
        offer = _Offer()
        offer.answer = LocalChoice(DECODE_A, 5, 10)  # would take it, if asked
        waiting = asyncio.create_task(admission.admit(_request(5), exclude=frozenset(),
                                                      timeout=10, local=offer))
        await asyncio.sleep(0.02)
        running.release(finished_tokens=10)
        slot = await waiting
        assert isinstance(slot, AdmissionSlot) and offer.asked == []
        with pytest.raises(ApiError) as err:
            await admission.admit(_request(8), exclude=frozenset(), timeout=0.05,
                                  local=_Offer())
        assert err.value.status == 504
        assert _sample(metrics, "pdserve_router_queue_requests", pod=POD) == 0
        assert pool.in_flight(POD) == (0, 0)
        slot.release()

    run_async(scenario())


def test_the_rule_tells_a_waiter_when_a_local_prefill_frees_its_pod(run_async):
    async def scenario():
        pool = _Pool(_load(DECODE_A, "decode"))
        rule = LocalPrefill(pool, lambda exclude: Ahead(0), LocalPrefillSettings(max_tokens=8))
        assert LocalPrefill(pool, lambda exclude: Ahead(0),
                            LocalPrefillSettings(below=8)).offer_for(
            [1, 2], max_context=10, exclude=frozenset()) is None  # the queue rule is off
        offer = rule.offer_for([1, 2, 3, 4, 5, 6], max_context=20, exclude=frozenset())
        with rule.computing(LocalChoice(DECODE_A, 4, 100)) as first_token:
            assert offer.offer(Ahead(100)) is None  # 4 + 6 > the budget of 8
            assert offer.offer(Ahead(3)) is None
            changed = offer.changed()
            assert not changed.done()
            first_token()
            assert changed.done()
        assert offer.offer(Ahead(3)) is None  # fewer tokens ahead than its own 6
        assert offer.offer(Ahead(100)) == LocalChoice(DECODE_A, 6, 100)

    run_async(scenario())


def test_the_local_rate_is_the_tokens_taken_within_the_window_per_second():
    rate = LocalRate()
    assert rate.tokens_per_s(0.0) == 0.0
    rate.took(400, 10.0)
    rate.took(200, 15.0)
    assert rate.tokens_per_s(15.0) == pytest.approx(600 / LOCAL_RATE_WINDOW_S)
    assert rate.tokens_per_s(10.0 + LOCAL_RATE_WINDOW_S) == pytest.approx(
        200 / LOCAL_RATE_WINDOW_S)
    assert rate.tokens_per_s(15.0 + LOCAL_RATE_WINDOW_S) == 0.0


def test_every_local_prefill_the_rule_lets_start_counts_toward_its_rate():
    rule = LocalPrefill(_Pool(_load(DECODE_A, "decode")), lambda exclude: Ahead(0),
                        LocalPrefillSettings(max_tokens=64))
    with rule.computing(LocalChoice(DECODE_A, 40, 100)):  # taken at arrival or from the queue
        pass
    with rule.computing(LocalChoice(DECODE_A, 20, -1)):  # below --local-prefill-below
        pass
    assert rule.rate.tokens_per_s(time.monotonic()) == pytest.approx(60 / LOCAL_RATE_WINDOW_S)


def test_shedding_counts_the_prompts_decode_pods_prefill_themselves(run_async):
    """A queue whose prompts decode pods help compute is not shed as if the
    prefill pod computed all of it: the wait is the tokens ahead over the
    pod's peak rate plus the decode pods' recent local prefill rate (shared
    among the prefill pods). The idle side's own gate still reads the pod's
    rate alone."""
    async def scenario():
        local = LocalRate()
        admission, _, pool = _admission(dispatch_tokens=100, max_queue_wait=0.75, local=local)
        for i in range(3):  # MIN_SAMPLES prefills: at most 500 tokens/s
            slot = await admission.admit(_request(50, f"learn-{i}"), exclude=frozenset(),
                                         timeout=10)
            await asyncio.sleep(0.1)
            slot.release(finished_tokens=50)
        running = await admission.admit(_request(100), exclude=frozenset(), timeout=10)
        queued = [asyncio.create_task(admission.admit(_request(100, f"q{i}"),
                                                      exclude=frozenset(), timeout=10))
                  for i in range(2)]
        await asyncio.sleep(0.02)
        peak = admission._queues[POD].throughput.peak_tokens_per_s(time.monotonic())
        # at the prefill pod's rate alone the next (300 ahead, its own 100) is shed
        assert 400 / peak > 0.75
        assert admission.estimated_wait(POD) == pytest.approx(300 / peak, rel=0.01)
        local.took(40_000, time.monotonic())  # decode pods prefilled 40,000 tokens just now
        helped = 40_000 / LOCAL_RATE_WINDOW_S
        assert admission.estimated_wait(POD) == pytest.approx(300 / (peak + helped), rel=0.01)
        assert admission.least_ahead(frozenset()).wait == pytest.approx(300 / peak, rel=0.01)
        # counted with the decode pods' share it waits under the limit: queued, not 429
        accepted = asyncio.create_task(admission.admit(_request(100, "next"),
                                                       exclude=frozenset(), timeout=10))
        await asyncio.sleep(0.02)
        assert not accepted.done()
        pool.waiting_tokens[OTHER] = 0  # a second prefill pod: each gets half the share
        assert admission.estimated_wait(POD) == pytest.approx(
            400 / (peak + helped / 2), rel=0.01)
        running.release(finished_tokens=100)
        for task in (*queued, accepted):
            (await task).release(finished_tokens=100)

    run_async(scenario())
