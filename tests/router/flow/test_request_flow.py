"""RequestFlow against in-process fake pods: the happy paths, every retry and
move, stop strings, cancellation and the errors the client sees."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from router.api_error import ApiError
from router.flow.deps import FlowDeps, FlowSettings
from router.flow.request_flow import RequestFlow
from router.flow.state import FlowState
from router.generation import GenerationRequest
from router.metrics import RouterMetrics
from router.pod_channels import PodChannels
from router.registry.poller import PolledPodPool
from router.registry.static import StaticPodSource
from router.routing.admission import AdmissionSettings, PrefillAdmission
from router.routing.colocated_gate import ColocatedGate
from router.routing.ledger import MIN_SAMPLES
from router.routing.policy import RoutingPolicy
from router.sampling import SamplingSpec
from router.sessions import InMemorySessionStore
from tests.router.inprocess_pods import (
    Behaviour,
    FakePod,
    LetterDetokenizer,
    Wire,
    expected_text,
    expected_token,
)

pytestmark = pytest.mark.timeout(60)
PROMPT = (5, 9, 2, 7)


class Cluster:
    """Fake pods + the router-side objects a flow needs."""

    def __init__(self, max_queue_wait: float | None = None, **settings) -> None:
        self.max_queue_wait = max_queue_wait  # None: no ColocatedGate
        self.wire = Wire()
        self.pods: dict[str, list[FakePod]] = {"prefill": [], "decode": [], "colocated": []}
        self.settings = FlowSettings(**settings)
        self.metrics = RouterMetrics()

    async def add(self, role: str, **behaviour) -> FakePod:
        pod = FakePod(role, self.wire, Behaviour(**behaviour))
        await pod.start()
        self.pods[role].append(pod)
        return pod

    async def __aenter__(self) -> Cluster:
        source = StaticPodSource(**{r: [p.address for p in pods] for r, pods in self.pods.items()})
        self.pool = PolledPodPool(source, poll_interval=30)
        await self.pool.start()
        self.channels = PodChannels()
        policy = RoutingPolicy(self.pool, InMemorySessionStore())
        self.gate = None if self.max_queue_wait is None else ColocatedGate(
            self.pool, self.metrics, self.max_queue_wait)
        self.deps = FlowDeps(pool=self.pool, policy=policy,
                             channels=self.channels, metrics=self.metrics,
                             settings=self.settings,
                             admission=PrefillAdmission(self.pool, policy, self.metrics,
                                                        AdmissionSettings()),
                             colocated_gate=self.gate)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channels.close()
        await self.pool.close()
        for pods in self.pods.values():
            for pod in pods:
                await pod.stop()

    def flow(self, max_tokens: int = 6, rid: str = "r1", **sampling) -> RequestFlow:
        request = GenerationRequest(rid, PROMPT, SamplingSpec(max_tokens=max_tokens, **sampling))
        return RequestFlow(request, deps=self.deps, detokenizer=LetterDetokenizer())

    def sample(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


async def _collect(flow: RequestFlow, sink=None, deltas: list | None = None) -> list:
    """The deltas `flow.run(sink)` yields, appended to `deltas` (a sink may
    append its own there too, so the list is what the client would read)."""
    deltas = [] if deltas is None else deltas
    async with contextlib.aclosing(flow.run(sink)) as stream:
        async for delta in stream:
            deltas.append(delta)
    return deltas


def _text(deltas) -> str:
    return "".join(d.text for d in deltas)


def run(coro):
    return asyncio.run(coro)


def test_disaggregated_first_token_alone_then_decode():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill", cached_tokens=2)
        decode = await cluster.add("decode")
        async with cluster:
            flow = cluster.flow(max_tokens=6)
            deltas = await _collect(flow)
        assert deltas[0].token_ids == (expected_token(PROMPT, 0),)
        assert _text(deltas) == expected_text(PROMPT, 6)
        final = deltas[-1]
        assert final.finish_reason == "length"
        assert (final.usage.prompt_tokens, final.usage.completion_tokens,
                final.usage.cached_tokens) == (4, 6, 2)
        assert flow.state is FlowState.FINISHED
        (generate,) = decode.requests
        assert generate.remote_prefill and list(generate.prompt_token_ids) == list(PROMPT)
        assert generate.sampling.max_tokens == 6
        assert cluster.sample("pdserve_time_to_first_token_seconds_count", role="router",
                              path="disaggregated") == 1
        assert cluster.sample("pdserve_inter_token_latency_seconds_count", role="router",
                              path="disaggregated") == 5
    run(main())


def test_colocated_only():
    async def main():
        cluster = Cluster()
        pod = await cluster.add("colocated", cached_tokens=3)
        async with cluster:
            deltas = await _collect(cluster.flow(max_tokens=4))
        assert _text(deltas) == expected_text(PROMPT, 4)
        assert deltas[-1].usage.cached_tokens == 3
        assert not pod.requests[0].remote_prefill
    run(main())


def _backlog(gate: ColocatedGate, address: str, tokens: int) -> None:
    """Teach `gate` a rate for `address` (at most 10,000 tokens/s), then leave
    `tokens` outstanding there."""
    for _ in range(MIN_SAMPLES):
        slot = gate.sent(address, 100)
        time.sleep(0.01)
        slot.release(100)
    gate.sent(address, tokens)


def test_colocated_pod_beyond_the_wait_limit_is_skipped():
    async def main():
        cluster = Cluster(max_queue_wait=5.0)
        pods = [await cluster.add("colocated") for _ in range(2)]
        async with cluster:
            await _collect(cluster.flow(max_tokens=3, rid="first"))
            # the pod routing picks for PROMPT (rendezvous on its first tokens)
            (preferred,) = [pod for pod in pods if pod.requests]
            (other,) = [pod for pod in pods if pod is not preferred]
            _backlog(cluster.gate, preferred.address, 10**6)
            for i in range(3):
                deltas = await _collect(cluster.flow(max_tokens=3, rid=f"r{i}"))
                assert _text(deltas) == expected_text(PROMPT, 3)
            # the gate learnt from every first token, and nothing is left outstanding
            assert cluster.gate.estimated_wait(other.address) == 0.0
        assert len(preferred.requests) == 1 and len(other.requests) == 3
        assert cluster.sample("pdserve_router_queue_rejected_total") == 0
    run(main())


def test_every_colocated_pod_beyond_the_wait_limit_is_429():
    async def main():
        cluster = Cluster(max_queue_wait=5.0)
        pods = [await cluster.add("colocated") for _ in range(2)]
        async with cluster:
            for pod in pods:
                _backlog(cluster.gate, pod.address, 10**6)
            with pytest.raises(ApiError) as info:
                await _collect(cluster.flow())
        assert info.value.status == 429 and info.value.code == "queue_full"
        assert "above the limit --max-queue-wait 5s" in info.value.message
        assert not any(pod.requests for pod in pods)
        assert cluster.sample("pdserve_router_queue_rejected_total") == 1
    run(main())


def test_full_decode_pod_is_skipped():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        full = await cluster.add("decode", full=True)
        ok = await cluster.add("decode")
        async with cluster:
            deltas = await _collect(cluster.flow())
        assert _text(deltas) == expected_text(PROMPT, 6)
        assert len(ok.requests) == 1
        assert cluster.sample("pdserve_retries_total", role="decode") == len(full.requests)
    run(main())


def test_every_decode_pod_full_is_503():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        await cluster.add("decode", full=True)
        async with cluster:
            with pytest.raises(ApiError) as info:
                await _collect(cluster.flow())
        assert info.value.status == 503
        assert "RESOURCE_EXHAUSTED: no free KV blocks" in info.value.message
    run(main())


def test_prefill_failure_retries_against_the_same_reservation():
    async def main():
        cluster = Cluster()
        bad = await cluster.add("prefill", fail_prefill=True)
        # the good pod reports a long queue, so the policy tries the bad one first
        good = await cluster.add("prefill", waiting_tokens=100_000)
        decode = await cluster.add("decode")
        async with cluster:
            deltas = await _collect(cluster.flow())
        assert _text(deltas) == expected_text(PROMPT, 6)
        (reservation,) = decode.requests  # one reservation, reused by the retry
        ((tried,), (retried,)) = bad.requests, good.requests
        assert tried.request_id == retried.request_id == reservation.request_id
        assert tried.target.ticket == retried.target.ticket == b"r1-1"
        assert cluster.sample("pdserve_retries_total", role="prefill") == 1
        assert cluster.sample("pdserve_migrations_total") == 0
    run(main())


def test_failed_transfer_starts_over_with_a_new_reservation():
    async def main():
        cluster = Cluster()
        prefill = await cluster.add("prefill", abort_prefill_once=True)
        decode = await cluster.add("decode")
        async with cluster:
            deltas = await _collect(cluster.flow())
        assert _text(deltas) == expected_text(PROMPT, 6)
        # the reservation died with the transfer: a second one, on the same (healthy) pods
        assert [r.request_id for r in decode.requests] == ["r1-1", "r1-2"]
        assert [r.request_id for r in prefill.requests] == ["r1-1", "r1-2"]
        assert cluster.sample("pdserve_retries_total", role="prefill") == 1
        assert cluster.sample("pdserve_migrations_total") == 0
    run(main())


def test_first_token_reaches_the_client_before_the_transfer_verdict():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill", transfer_delay=1.0)
        decode = await cluster.add("decode")
        async with cluster:
            flow = cluster.flow(max_tokens=4)
            started = asyncio.get_running_loop().time()
            async with contextlib.aclosing(flow.run()) as stream:
                first = await anext(stream)
                first_at = asyncio.get_running_loop().time() - started
                # the decode pod has not been given the KV yet: token 0 came from prefill alone
                assert not cluster.wire.event("r1-1").is_set()
                rest = [d async for d in stream]
        assert first.token_ids == (expected_token(PROMPT, 0),)
        assert first_at < 0.5  # well before the 1 s transfer ended
        assert _text([first, *rest]) == expected_text(PROMPT, 4)
        assert len(decode.requests) == 1
        assert cluster.sample("pdserve_migrations_total") == 0
    run(main())


def test_transfer_failing_after_the_first_token_moves_with_that_token_as_output():
    async def main():
        cluster = Cluster()
        prefill = await cluster.add("prefill", transfer_delay=0.2, fail_transfer_once=True)
        decode = await cluster.add("decode")
        async with cluster:
            deltas = await _collect(cluster.flow(max_tokens=6))
            await asyncio.sleep(0.1)
            assert not decode.active  # the first reservation's stream was cancelled at once
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == [expected_token(PROMPT, i) for i in range(6)]  # none twice, none lost
        assert [r.request_id for r in decode.requests] == ["r1-1", "r1-2"]
        # the move carries the token the client already has; the new prefill starts after it
        first_try, moved = prefill.requests
        assert list(first_try.output_token_ids) == []
        assert list(moved.output_token_ids) == [expected_token(PROMPT, 0)]
        assert list(decode.requests[1].output_token_ids) == [expected_token(PROMPT, 0)]
        assert "r1-1" in decode.cancelled
        assert cluster.sample("pdserve_migrations_total") == 1
        assert cluster.sample("pdserve_retries_total", role="prefill") == 0
    run(main())


def test_all_prefill_pods_failing_gives_up_with_reason():
    async def main():
        cluster = Cluster(max_prefill_retries=1, max_migrations=0)
        await cluster.add("prefill", fail_prefill=True)
        await cluster.add("prefill", fail_prefill=True)
        decode = await cluster.add("decode")
        async with cluster:
            with pytest.raises(ApiError) as info:
                await _collect(cluster.flow())
            await asyncio.sleep(0.1)
            assert not decode.active  # the reservation's stream was cancelled
        assert info.value.status == 503
        assert "prefill failed on 2 pod(s)" in info.value.message
        assert "UNAVAILABLE: prefill pod is broken" in info.value.message
    run(main())


def test_no_pods_left_after_a_failure_says_what_failed():
    async def main():
        # one prefill pod that fails, migrations allowed: the retry finds no
        # pod left, and the 503 carries the failure that used them up
        cluster = Cluster(max_prefill_retries=0, max_migrations=2)
        await cluster.add("prefill", fail_prefill=True)
        await cluster.add("decode")
        async with cluster:
            with pytest.raises(ApiError) as info:
                await _collect(cluster.flow())
        assert info.value.status == 503 and info.value.code == "no_pod_available"
        assert info.value.message.startswith("no pod can serve the request")
        assert "this request's last failure:" in info.value.message
        assert "UNAVAILABLE: prefill pod is broken" in info.value.message
    run(main())


def test_decode_failure_migrates_without_duplicates_or_gaps():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        first = await cluster.add("decode", break_after=2)
        second = await cluster.add("decode", repeat=2)  # resends 2 known tokens
        async with cluster:
            # make `first` the chosen decode pod: the second looks busier
            second.active.update({"x", "y"})
            await cluster.pool.poll_once()
            deltas = await _collect(cluster.flow(max_tokens=8))
        assert _text(deltas) == expected_text(PROMPT, 8)
        indices = [t for d in deltas for t in d.token_ids]
        assert indices == [expected_token(PROMPT, i) for i in range(8)]
        assert len(first.requests) == 1
        (moved,) = second.requests
        # token 0 from prefill + 2 from the first decode pod travel as context
        assert list(moved.output_token_ids) == [expected_token(PROMPT, i) for i in range(3)]
        assert cluster.sample("pdserve_migrations_total") == 1
    run(main())


def test_decode_pod_without_reserved_answer_is_left_out():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        odd = await cluster.add("decode", no_reserved=True)
        good = await cluster.add("decode")
        async with cluster:
            # make `odd` the first choice: `good` looks busy
            good.active.update(f"busy-{i}" for i in range(20))
            await cluster.pool.poll_once()
            good.active.clear()
            deltas = await _collect(cluster.flow())
        assert _text(deltas) == expected_text(PROMPT, 6)
        assert [r.request_id for r in odd.requests] == ["r1-1"]
        assert [r.request_id for r in good.requests] == ["r1-2"]
        assert cluster.sample("pdserve_migrations_total") == 1
    run(main())


def test_gap_counts_as_a_failed_decode_pod():
    async def main():
        cluster = Cluster(max_migrations=0)
        await cluster.add("prefill")
        await cluster.add("decode", gap=True)
        async with cluster:
            with pytest.raises(ApiError) as info:
                await _collect(cluster.flow())
        assert info.value.status == 503
        assert "sent tokens from index 3 but the next expected is 2" in info.value.message
    run(main())


def test_no_pods_is_503_with_reason():
    async def main():
        cluster = Cluster()
        await cluster.add("decode")
        async with cluster:
            with pytest.raises(ApiError) as info:
                await _collect(cluster.flow())
        assert info.value.status == 503 and info.value.code == "no_pod_available"
        assert info.value.message.startswith(
            "no pod can serve the request: no healthy prefill pod and no healthy colocated pod"
        )
    run(main())


def test_stop_string_trims_and_cancels_decode():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        decode = await cluster.add("decode", delay=0.02)
        full = expected_text(PROMPT, 12)
        stop = full[3:5]
        async with cluster:
            deltas = await _collect(cluster.flow(max_tokens=12, stop=(stop,)))
            await asyncio.sleep(0.2)
            assert not decode.active
        assert _text(deltas) == full[: full.index(stop)]
        assert deltas[-1].finish_reason == "stop"
        assert deltas[-1].usage.completion_tokens == 5
        assert cluster.sample("pdserve_aborts_total", reason="stop_string") == 1
    run(main())


def test_client_leaving_cancels_the_decode_stream():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        decode = await cluster.add("decode", delay=0.05)
        async with cluster:
            flow = cluster.flow(max_tokens=50)
            async with contextlib.aclosing(flow.run()) as stream:
                async for delta in stream:
                    if delta.token_ids and delta.token_ids[0] == expected_token(PROMPT, 2):
                        break
            await asyncio.sleep(0.3)
            assert not decode.active
            assert decode.cancelled == ["r1-1"]
        assert flow.state is FlowState.FAILED
        assert cluster.sample("pdserve_aborts_total", reason="client_disconnect") == 1
    run(main())


def test_invalid_argument_from_pod_is_400_and_timeout_is_504():
    async def main():
        cluster = Cluster(request_timeout=0.3)
        await cluster.add("colocated", invalid="prompt too long for this pod")
        slow = Cluster(request_timeout=0.3)
        await slow.add("colocated", delay=0.2)
        async with cluster, slow:
            with pytest.raises(ApiError) as bad:
                await _collect(cluster.flow())
            with pytest.raises(ApiError) as late:
                await _collect(slow.flow(max_tokens=20))
        assert bad.value.status == 400
        assert bad.value.message.endswith("prompt too long for this pod")
        assert late.value.status == 504
        assert late.value.message == "the request did not finish within --request-timeout 0.3s"
        assert slow.sample("pdserve_aborts_total", reason="timeout") == 1
    run(main())


def test_colocated_pod_failure_moves_to_another_colocated_pod():
    async def main():
        cluster = Cluster()
        first = await cluster.add("colocated", break_after=3)
        second = await cluster.add("colocated")
        async with cluster:
            # look far over the bounded-load limit, so `first` is chosen first
            second.active.update(f"busy-{i}" for i in range(20))
            await cluster.pool.poll_once()
            deltas = await _collect(cluster.flow(max_tokens=9))
        assert _text(deltas) == expected_text(PROMPT, 9)
        assert len(first.requests) == 1
        (moved,) = second.requests
        assert not moved.remote_prefill
        assert list(moved.output_token_ids) == [expected_token(PROMPT, i) for i in range(3)]
        assert cluster.sample("pdserve_migrations_total") == 1
    run(main())

