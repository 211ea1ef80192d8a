"""Router.Generate / ListModels / health against in-process fake pods."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.router.http_harness import fake_cluster
from tests.router.inprocess_pods import Behaviour, expected_token

pytestmark = pytest.mark.timeout(120)
PD = {"prefill": [Behaviour()], "decode": [Behaviour()]}


def run(coro):
    return asyncio.run(coro)


async def _generate(stub, request, metadata=()):
    return [m async for m in stub.Generate(request, metadata=metadata)]


def test_generate_streams_tokens_text_and_usage(tiny_model_dir):
    async def main():
        async with fake_cluster(tiny_model_dir, PD) as (server, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                stub = pdserve_pb2_grpc.RouterStub(channel)
                request = pb.GenerateRequest(prompt_token_ids=[7, 8, 9], request_id="mine",
                                             sampling=pb.SamplingParams(max_tokens=5))
                messages = await _generate(stub, request)
                models = await stub.ListModels(pb.ListModelsRequest())
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""))
        tokens = [t for m in messages for t in m.token_ids]
        assert tokens == [expected_token([7, 8, 9], i) for i in range(5)]
        assert {m.request_id for m in messages} == {"mine"}
        assert [m.finish_reason for m in messages][-1] == "length"
        assert all(m.finish_reason == "" for m in messages[:-1])
        last = messages[-1].usage
        assert (last.prompt_tokens, last.completion_tokens) == (3, 5)
        assert [(m.id, m.max_model_len) for m in models.models] == [("tiny", 4096)]
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    run(main())


@pytest.mark.parametrize(
    ("request_fields", "code", "fragment"),
    [
        ({"prompt": "x", "model": "other"}, grpc.StatusCode.NOT_FOUND, "'other' does not exist"),
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "set exactly one of prompt, messages"),
        ({"prompt": "x", "sampling": pb.SamplingParams(top_p=1.5)},
         grpc.StatusCode.INVALID_ARGUMENT, "'top_p' must be in (0, 1], got 1.5"),
        ({"prompt": "x", "sampling": pb.SamplingParams(max_tokens=5000)},
         grpc.StatusCode.INVALID_ARGUMENT, "maximum context length is 4096"),
        ({"prompt": "x" * 131_073}, grpc.StatusCode.INVALID_ARGUMENT,
         "'prompt' has 131073 characters, over the limit of 131072 (max_model_len 4096 x 32"),
    ],
)
def test_generate_refuses_bad_requests(tiny_model_dir, request_fields, code, fragment):
    async def main():
        async with fake_cluster(tiny_model_dir, PD) as (server, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                stub = pdserve_pb2_grpc.RouterStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _generate(stub, pb.GenerateRequest(**request_fields))
        assert info.value.code() == code
        assert fragment in info.value.details()
    run(main())


def test_api_key_on_grpc(tiny_model_dir):
    async def main():
        async with fake_cluster(tiny_model_dir, PD, api_key="k3y") as (server, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                stub = pdserve_pb2_grpc.RouterStub(channel)
                request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _generate(stub, request)
                ok = await _generate(stub, request, metadata=(("authorization", "Bearer k3y"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert ok[-1].usage.completion_tokens == 2
    run(main())


async def _read_to_end(call) -> list[pb.GenerateResponse]:
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def test_per_client_concurrency_on_grpc(tiny_model_dir):
    """--max-concurrent-per-client holds on the gRPC front door too: a third
    stream from one address is RESOURCE_EXHAUSTED naming the limit while two
    stream on, and a slot frees when a stream ends."""
    async def main():
        roles = {"colocated": [Behaviour(delay=0.05)]}
        async with fake_cluster(tiny_model_dir, roles, max_concurrent_per_client=2) as (server,
                                                                                      _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                stub = pdserve_pb2_grpc.RouterStub(channel)
                request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(
                    max_tokens=40))
                calls = [stub.Generate(request) for _ in range(2)]
                for call in calls:
                    await call.read()  # both hold a slot now
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _generate(stub, request)
                rest = [await _read_to_end(call) for call in calls]
                again = await _generate(stub, pb.GenerateRequest(
                    prompt="hi", sampling=pb.SamplingParams(max_tokens=2)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the limit is 2 per client address" in info.value.details()
        assert all(r[-1].finish_reason == "length" for r in rest)
        assert again[-1].usage.completion_tokens == 2
    run(main())


def test_cancelled_generate_cancels_the_pod_call(tiny_model_dir):
    async def main():
        roles = {"colocated": [Behaviour(delay=0.05)]}
        async with fake_cluster(tiny_model_dir, roles) as (server, pods):
            pod = pods["colocated"][0]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                call = pdserve_pb2_grpc.RouterStub(channel).Generate(pb.GenerateRequest(
                    prompt="hi", sampling=pb.SamplingParams(max_tokens=500)))
                await call.read()
                assert len(pod.active) == 1
                call.cancel()
                for _ in range(100):
                    if not pod.active:
                        break
                    await asyncio.sleep(0.05)
            assert not pod.active and len(pod.cancelled) == 1
    run(main())


def test_response_message_carries_logprobs_only_when_the_delta_has_them():
    from router.generation import Delta, OutputLogprobs, Usage
    from router.grpc_server import response_message

    plain = response_message("r1", Delta(text="ab", token_ids=(5, 6)))
    assert (plain.request_id, plain.text, list(plain.token_ids)) == ("r1", "ab", [5, 6])
    assert len(plain.logprobs) == 0 and plain.finish_reason == "" and not plain.HasField("usage")

    lps = (OutputLogprobs(5, -0.25, (5, 9), (-0.25, -2.0)), OutputLogprobs(6, -1.5, (), ()))
    final = response_message("r2", Delta(text="c", token_ids=(5, 6), logprobs=lps,
                                         finish_reason="length",
                                         usage=Usage(prompt_tokens=3, completion_tokens=2,
                                                     cached_tokens=1)))
    assert [(lp.token_id, lp.logprob, list(lp.top_token_ids), list(lp.top_logprobs))
            for lp in final.logprobs] == [(5, -0.25, [5, 9], [-0.25, -2.0]), (6, -1.5, [], [])]
    assert final.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens,
            final.usage.cached_tokens) == (3, 2, 1)


def test_grpc_refuses_prompt_logprobs():
    from router.api_error import ApiError
    from router.grpc_server import parsed_request

    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(prompt_logprobs=1))
    with pytest.raises(ApiError, match="prompt_logprobs is not supported by the router's gRPC"):
        parsed_request(request, "tiny")


def _with_field(message, number: int) -> bytes:
    """`message` serialized with a varint field `number` appended (what a
    client built from a newer proto sends)."""
    return message.SerializeToString() + bytes([(number << 3) & 0x7F | 0x80, number >> 4, 1])


@pytest.mark.parametrize(("build", "param", "message"), [
    (lambda: pb.GenerateRequest.FromString(_with_field(pb.GenerateRequest(prompt="hi"), 99)),
     "99", "pdserve.v1.GenerateRequest has field number 99, which this server's proto does "
           "not define: the router refuses what it cannot honour"),
    (lambda: pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams.FromString(
        _with_field(pb.SamplingParams(max_tokens=3), 40))),
     "sampling.40", "'sampling' (pdserve.v1.SamplingParams) has field number 40"),
    (lambda: pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="a"),
                                          pb.ChatMessage.FromString(_with_field(
                                              pb.ChatMessage(role="user", content="b"), 17))]),
     "messages[1].17", "'messages[1]' (pdserve.v1.ChatMessage) has field number 17"),
])
def test_grpc_refuses_fields_its_proto_does_not_define(build, param, message):
    from router.api_error import ApiError
    from router.grpc_server import parsed_request

    with pytest.raises(ApiError) as info:
        parsed_request(build(), "tiny")
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(message)
    known = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(
        max_tokens=3, logit_bias={5: 1.0}, grammar=pb.Grammar(regex="a")))
    assert parsed_request(known, "tiny").sampling.max_tokens == 3
