"""`PodChannels.open_generate` over `DecodeStream` against in-process fake pods
(the real pods' DecodeStreamMux over a deterministic Generate): sharing, cancel,
deadline, a broken session, and pods without Session."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import pdserve_pb2 as pb
from router.pod_channels import PodChannels
from tests.router.inprocess_pods import Behaviour, FakePod, Wire, expected_token

pytestmark = pytest.mark.timeout(60)
PROMPT = [5, 9, 2, 7]


def _request(rid: str, max_tokens: int = 5) -> pb.DecodeGenerateRequest:
    return pb.DecodeGenerateRequest(request_id=rid, prompt_token_ids=PROMPT,
                                    sampling=pb.SamplingParams(max_tokens=max_tokens))


async def _read_all(call, first) -> list[int]:
    tokens, message = [], first
    while True:
        tokens.extend(message.tokens.token_ids)
        if message.tokens.finish_reason:
            return tokens
        message = await call.read()


async def _pod(**behaviour) -> FakePod:
    pod = FakePod("colocated", Wire(), Behaviour(**behaviour))
    await pod.start()
    return pod


def test_requests_share_one_session_and_a_cancel_touches_one():
    async def main():
        pod, channels = await _pod(delay=0.02), PodChannels()
        try:
            opened = [await channels.open_generate(pod.address, _request(f"r{i}", 20), 30)
                      for i in range(3)]
            (victim, _), *others = opened
            assert victim.cancel() and not victim.cancel()
            outputs = await asyncio.gather(*(_read_all(c, f) for c, f in others))
            assert outputs == [[expected_token(PROMPT, i) for i in range(20)]] * 2
            assert await victim.read() is grpc.aio.EOF
            assert pod.sessions == 1 and pod.cancelled == ["r0"]
        finally:
            await channels.close()
            await pod.stop()

    asyncio.run(main())


def test_a_session_that_fails_before_any_message_falls_back_to_generate():
    """gRPC core can report a stream the pod closed at once as its own
    INTERNAL rather than the pod's UNIMPLEMENTED: such a request still gets
    Generate (and the pod is not marked as having no Session)."""
    async def main():
        pod, channels = await _pod(session_internal=True), PodChannels()
        try:
            call, first = await channels.open_generate(pod.address, _request("a"), 30)
            assert await _read_all(call, first) == [expected_token(PROMPT, i) for i in range(5)]
            assert [r.request_id for r in pod.requests] == ["a"]
            assert pod.address not in channels._no_session
        finally:
            await channels.close()
            await pod.stop()

    asyncio.run(main())


def test_a_deadline_fails_the_request_and_cancels_it_on_the_pod():
    async def main():
        pod, channels = await _pod(delay=0.5), PodChannels()
        try:
            call, first = await channels.open_generate(pod.address, _request("slow"), 0.8)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _read_all(call, first)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(100):
                if pod.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert pod.cancelled == ["slow"]
        finally:
            await channels.close()
            await pod.stop()

    asyncio.run(main())


def _command_feeds() -> int:
    """gRPC's tasks feeding Session streams their commands, running now."""
    return sum("_consume_request_iterator" in repr(task.get_coro())
               for task in asyncio.all_tasks())


def test_errors_keep_their_status_and_a_broken_session_fails_every_request():
    async def main():
        full, pod, channels = await _pod(full=True), await _pod(delay=0.05), PodChannels()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channels.open_generate(full.address, _request("r"), 30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            opened = [await channels.open_generate(pod.address, _request(f"r{i}", 100), 30)
                      for i in range(3)]
            feeds_before = _command_feeds()
            await pod.stop()  # the pod goes away under its session
            for call, first in opened:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _read_all(call, first)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert pod.sessions == 1
            # the broken session's command feed ends too: no task of it is left
            # waiting for commands (it would be destroyed pending, a logged error);
            # the session to `full` is alive and keeps its own
            await asyncio.sleep(0.05)
            assert _command_feeds() == feeds_before - 1
        finally:
            await channels.close()
            await full.stop()

    asyncio.run(main())


def test_a_pod_without_session_gets_generate():
    async def main():
        pod, channels = await _pod(no_session=True), PodChannels()
        try:
            for rid in ("a", "b"):
                call, first = await channels.open_generate(pod.address, _request(rid), 30)
                assert await _read_all(call, first) == [expected_token(PROMPT, i)
                                                        for i in range(5)]
            assert [r.request_id for r in pod.requests] == ["a", "b"]
            assert pod.sessions == 0
        finally:
            await channels.close()
            await pod.stop()

    asyncio.run(main())


def test_the_relay_takes_plain_events_while_the_reader_waits_and_a_failing_one_is_dropped():
    """StreamCall.relay: tokens events that arrive while the task waits in
    read() go to the callback; the finish goes to read(); a callback that
    raises is logged and dropped (the session's other requests go on), and
    read() gets every later event."""
    async def main():
        pod, counts = await _pod(delay=0.01), []
        channels = PodChannels(on_relayed=counts.append)
        try:
            call, first = await channels.open_generate(pod.address, _request("a", 12), 30)
            other, other_first = await channels.open_generate(pod.address, _request("b", 12), 30)
            relayed: list[int] = []

            def relay(tokens) -> int:
                assert not tokens.finish_reason
                if len(relayed) == 3:
                    raise RuntimeError("a bug in the relay")
                relayed.extend(tokens.token_ids)
                return len(tokens.token_ids)

            call.relay = relay
            read, read_other = await asyncio.gather(_read_all(call, first),
                                                    _read_all(other, other_first))
            expected = [expected_token(PROMPT, i) for i in range(12)]
            assert read_other == expected
            assert len(relayed) == 3 and call.relay is None
            k = next(i for i in range(12) if expected[i:i + 3] == relayed)
            assert read == expected[:k] + expected[k + 3:]
            assert sum(counts) == 3
        finally:
            await channels.close()
            await pod.stop()

    asyncio.run(main())
