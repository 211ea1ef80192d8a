"""A request whose prompt a decode pod prefills itself (`router/flow/local_path.py`),
against in-process fake pods: the path, the fallback to P/D when the pod
refuses, and a broken local stream moving the request like any other."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from router.flow.state import FlowState
from router.generation import GenerationRequest
from router.routing.admission import AdmissionSlot
from router.routing.local_prefill import LocalPrefill, LocalPrefillSettings
from router.sampling import SamplingSpec
from tests.router.flow.test_request_flow import PROMPT, Cluster, _collect, _text, run
from tests.router.inprocess_pods import expected_text


async def _with_rule(cluster: Cluster, *, busy_tokens: int, max_tokens: int = 64
                     ) -> AdmissionSlot:
    """Give the cluster's flows the local-prefill rule (the router's wiring),
    with `busy_tokens` dispatched to the prefill pod (the slot returned holds
    them until released)."""
    rule = LocalPrefill(cluster.pool, cluster.deps.admission.least_ahead,
                        LocalPrefillSettings(max_tokens=max_tokens))
    cluster.deps = dataclasses.replace(cluster.deps, local_prefill=rule)
    busy = GenerationRequest("busy", tuple(range(5, 5 + busy_tokens)), SamplingSpec(max_tokens=1))
    return await cluster.deps.admission.admit(busy, exclude=frozenset(), timeout=5)


def test_a_busy_prefill_pod_sends_a_short_prompt_to_the_decode_pod():
    async def main():
        cluster = Cluster()
        prefill = await cluster.add("prefill")
        decode = await cluster.add("decode")
        async with cluster:
            await _with_rule(cluster, busy_tokens=100)
            flow = cluster.flow(max_tokens=6)
            deltas = await _collect(flow)
        assert _text(deltas) == expected_text(PROMPT, 6)
        assert flow.state is FlowState.FINISHED
        (generate,) = decode.requests
        assert not generate.remote_prefill and list(generate.prompt_token_ids) == list(PROMPT)
        assert prefill.requests == []
        assert cluster.sample("pdserve_router_local_prefills_total") == 1
        assert cluster.sample("pdserve_retries_total", role="decode") == 0
    run(main())


@pytest.mark.parametrize(("busy_tokens", "max_tokens"), [
    (3, 64),  # the prefill pod has fewer tokens dispatched than the prompt's 4
    (100, 3),  # the prompt is longer than --local-prefill-max-tokens
    (100, 0),  # the rule is off
])
def test_without_every_condition_the_request_takes_the_pd_path(busy_tokens, max_tokens):
    async def main():
        cluster = Cluster()
        prefill = await cluster.add("prefill")
        decode = await cluster.add("decode")
        async with cluster:
            await _with_rule(cluster, busy_tokens=busy_tokens, max_tokens=max_tokens)
            assert _text(await _collect(cluster.flow())) == expected_text(PROMPT, 6)
        assert [g.remote_prefill for g in decode.requests] == [True]
        assert len(prefill.requests) == 1
        assert cluster.sample("pdserve_router_local_prefills_total") == 0
    run(main())


def test_a_decode_pod_that_refuses_sends_the_request_down_the_pd_path():
    async def main():
        cluster = Cluster()
        prefill = await cluster.add("prefill")
        pods = [await cluster.add("decode"), await cluster.add("decode")]
        first, second = sorted(pods, key=lambda p: p.address)
        first.behaviour.full = True  # the rule picks it (first by address), it refuses
        async with cluster:
            await _with_rule(cluster, busy_tokens=100)
            flow = cluster.flow(max_tokens=6)
            deltas = await _collect(flow)
        assert _text(deltas) == expected_text(PROMPT, 6)
        assert flow.state is FlowState.FINISHED
        assert [g.remote_prefill for g in first.requests] == [False]
        assert [g.remote_prefill for g in second.requests] == [True]
        assert len(prefill.requests) == 1
        assert cluster.sample("pdserve_retries_total", role="decode") == 1
        assert cluster.sample("pdserve_router_local_prefills_total") == 0
        assert cluster.sample("pdserve_migrations_total") == 0
    run(main())


def test_a_local_stream_that_breaks_moves_the_request_to_another_decode_pod():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        pods = [await cluster.add("decode"), await cluster.add("decode")]
        first, second = sorted(pods, key=lambda p: p.address)
        first.behaviour.break_after = 2
        async with cluster:
            await _with_rule(cluster, busy_tokens=100)
            flow = cluster.flow(max_tokens=6)
            deltas = await _collect(flow)
        assert _text(deltas) == expected_text(PROMPT, 6)
        assert cluster.sample("pdserve_migrations_total") == 1
        (moved,) = second.requests  # prompt + the 2 tokens so far, prefilled there too
        assert not moved.remote_prefill and len(moved.output_token_ids) == 2
        assert cluster.sample("pdserve_router_local_prefills_total") == 2
    run(main())


def test_a_request_waiting_in_the_prefill_queue_is_taken_when_a_local_prefill_frees_its_pod():
    """Arrival is not the only moment: r2 arrives while r1's local prefill
    fills the decode pod's budget, so it queues for the (full) prefill pod;
    r1's first token frees the budget and the decode pod takes r2 from the
    queue (QueuedOffer)."""
    async def main():
        cluster = Cluster()
        prefill = await cluster.add("prefill")
        decode = await cluster.add("decode", delay=0.3)  # a local first token takes 0.3 s
        async with cluster:
            await _with_rule(cluster, busy_tokens=100, max_tokens=len(PROMPT))
            # a second prompt dispatched behind the one computing: no room for more
            busy = GenerationRequest("busy-2", tuple(range(5, 305)), SamplingSpec(max_tokens=1))
            await cluster.deps.admission.admit(busy, exclude=frozenset(), timeout=5)
            first = asyncio.create_task(_collect(cluster.flow(max_tokens=3, rid="r1")))
            await asyncio.sleep(0.05)
            second = cluster.flow(max_tokens=3, rid="r2")
            # without the offer r2 would wait for the busy prompts, which never finish
            deltas = await asyncio.wait_for(_collect(second), 10)
            await first
            queued = cluster.sample("pdserve_router_queue_requests",
                                    pod=prefill.address)
        assert _text(deltas) == expected_text(PROMPT, 3)
        assert [(g.request_id, g.remote_prefill) for g in decode.requests] == [
            ("r1-1", False), ("r2-1", False)]
        assert prefill.requests == [] and queued == 0
        assert cluster.sample("pdserve_router_local_prefills_total") == 2
        assert cluster.sample("pdserve_router_local_prefills_from_queue_total") == 1
        assert cluster.sample("pdserve_router_queue_wait_seconds_count") == 3
    run(main())
