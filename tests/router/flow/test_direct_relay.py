"""The direct relay (router.flow.direct_relay) through RequestFlow against
in-process fake pods: with a client sink, the deltas the session's reader
writes and those the flow yields make one exact, observed stream, through a
client that is sometimes full, a migration with repeats, and stop strings."""

from __future__ import annotations

import pytest

from router.flow.request_flow import RequestFlow
from router.generation import Delta
from tests.router.flow.test_request_flow import PROMPT, Cluster, _collect, _text, run
from tests.router.inprocess_pods import expected_text, expected_token

pytestmark = pytest.mark.timeout(60)


class RecordingSink:
    """A DeltaSink that appends to the list the task's deltas go to, so the
    list is what the client would read, in order. `ready` answers from
    `pattern`, cycled: a client whose socket is sometimes full."""

    def __init__(self, client: list, pattern=(True,)) -> None:
        self.client, self.relayed = client, []
        self._pattern, self._calls = pattern, 0

    def ready(self) -> bool:
        self._calls += 1
        return self._pattern[self._calls % len(self._pattern)]

    def send_text(self, text, token_ids) -> None:
        assert token_ids, "the relay writes no empty batch"
        delta = Delta(text=text, token_ids=tuple(token_ids))
        self.client.append(delta)
        self.relayed.append(delta)


async def _collect_with_sink(flow: RequestFlow, pattern=(True,)):
    client: list = []
    sink = RecordingSink(client, pattern)
    return await _collect(flow, sink, client), sink


@pytest.mark.parametrize("pattern", [(True,), (True, False)], ids=["ready", "sometimes-full"])
def test_the_direct_relay_keeps_the_stream_exact_and_observed(pattern):
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        await cluster.add("decode", delay=0.01)
        async with cluster:
            deltas, sink = await _collect_with_sink(cluster.flow(max_tokens=12), pattern)
        assert [t for d in deltas for t in d.token_ids] == [
            expected_token(PROMPT, i) for i in range(12)]
        assert _text(deltas) == expected_text(PROMPT, 12)
        assert deltas[-1].finish_reason == "length" and deltas[-1] not in sink.relayed
        # token 0 (prefill), token 1 (the first decode delta) and the final one
        # take the task's way; the relay writes what it is offered in between
        assert 1 <= len(sink.relayed) <= 9
        assert expected_token(PROMPT, 1) not in {t for d in sink.relayed for t in d.token_ids}
        assert cluster.sample("pdserve_time_to_first_token_seconds_count", role="router",
                              path="disaggregated") == 1
        assert cluster.sample("pdserve_inter_token_latency_seconds_count", role="router",
                              path="disaggregated") == 11
    run(main())


def test_the_direct_relay_survives_a_decode_pod_that_fails_and_one_that_repeats():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        first = await cluster.add("decode", break_after=5, delay=0.01)
        second = await cluster.add("decode", repeat=3, delay=0.01)
        async with cluster:
            second.active.update({"x", "y"})  # `first` is chosen first
            await cluster.pool.poll_once()
            deltas, sink = await _collect_with_sink(cluster.flow(max_tokens=12))
        assert [t for d in deltas for t in d.token_ids] == [
            expected_token(PROMPT, i) for i in range(12)]
        assert sink.relayed and len(first.requests) == len(second.requests) == 1
        assert cluster.sample("pdserve_migrations_total") == 1
    run(main())


def test_stop_strings_keep_every_delta_on_the_task():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        await cluster.add("decode", delay=0.01)
        full = expected_text(PROMPT, 12)
        stop = full[7:9]
        async with cluster:
            deltas, sink = await _collect_with_sink(cluster.flow(max_tokens=12, stop=(stop,)))
        assert _text(deltas) == full[: full.index(stop)]
        assert not sink.relayed
    run(main())


@pytest.mark.parametrize("sampling", [{"logprobs": 1}, {"prompt_logprobs": 1}],
                         ids=["logprobs", "prompt-logprobs"])
def test_a_request_for_logprobs_keeps_every_delta_on_the_task(sampling):
    """The relay writes text alone, and it no longer looks at a message's
    logprobs: a request that asked for them never gets the relay."""
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        await cluster.add("decode", delay=0.01)
        async with cluster:
            deltas, sink = await _collect_with_sink(cluster.flow(max_tokens=12, **sampling))
        assert _text(deltas) == expected_text(PROMPT, 12)
        assert not sink.relayed
    run(main())
