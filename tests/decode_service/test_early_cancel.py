"""A real decode pod (tiny model) whose reservations are cancelled early: many
`Generate` and `Session` requests cancelled while their reserve command still
waits behind the steps of a busy engine. Afterwards every slot and block is
back, the reserved gauges read 0, and the pod reserves `max_num_seqs` new
requests (issue 11, defect 1: each such cancel leaked a slot and its blocks)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.flows import wait_released
from tests.integration.pods import start_pod

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
MAX_NUM_SEQS = 8
NUM_CANCELLED = 48  # six times the slots: before the fix the pod ran out of them


@pytest.fixture(scope="module")
def pod(tiny_model_dir):
    process = start_pod("decode", tiny_model_dir, max_num_seqs=MAX_NUM_SEQS, block_size=16,
                        num_blocks=256, reservation_timeout=60, transfer_timeout=30)
    yield process
    process.kill()


def _request(rid: str, *, remote: bool, max_tokens: int = 16) -> pb.DecodeGenerateRequest:
    return pb.DecodeGenerateRequest(
        request_id=rid, prompt_token_ids=[5 + i % 50 for i in range(40)], remote_prefill=remote,
        sampling=pb.SamplingParams(max_tokens=max_tokens, top_p=1.0, ignore_eos=True))


async def _busy(stub: pdserve_pb2_grpc.DecodeStub, rid: str, started: asyncio.Event) -> None:
    """A long local generation: the engine steps while the reservations queue."""
    call = stub.Generate(_request(rid, remote=False, max_tokens=3000), timeout=120)
    async for _ in call:
        started.set()


async def _cancel_generates(stub, rng: random.Random) -> None:
    calls = [stub.Generate(_request(f"g{i}", remote=True), timeout=60)
             for i in range(NUM_CANCELLED)]
    for call in calls:
        await asyncio.sleep(rng.random() * 0.004)
        call.cancel()


async def _cancel_in_a_session(stub, rng: random.Random) -> None:
    commands: asyncio.Queue[pb.SessionCommand | None] = asyncio.Queue()

    async def feed():
        while (command := await commands.get()) is not None:
            yield command

    call = stub.Session(feed(), timeout=60)
    for i in range(NUM_CANCELLED):
        commands.put_nowait(pb.SessionCommand(generate=_request(f"s{i}", remote=True)))
        await asyncio.sleep(rng.random() * 0.004)
        commands.put_nowait(pb.SessionCommand(cancel=f"s{i}"))
    commands.put_nowait(None)
    async for _ in call:  # the session ends once every request has ended
        pass


async def _reserve_every_slot(stub) -> list[pb.Reserved]:
    calls = [stub.Generate(_request(f"full{i}", remote=True), timeout=60)
             for i in range(MAX_NUM_SEQS)]
    reserved = [(await call.read()).reserved for call in calls]
    for call in calls:
        call.cancel()
    return reserved


def _reserved_gauges(pod) -> tuple[float, float]:
    return (pod.metric_value("pdserve_requests_reserved"),
            pod.metric_value("pdserve_kv_blocks_reserved"))


def test_early_cancels_leak_no_slot_and_no_block(pod):
    async def scenario():
        async with grpc.aio.insecure_channel(pod.address) as channel:
            stub = pdserve_pb2_grpc.DecodeStub(channel)
            started = asyncio.Event()
            busy = [asyncio.create_task(_busy(stub, f"busy{i}", started)) for i in range(2)]
            await asyncio.wait_for(started.wait(), 60)
            rng = random.Random(11)
            await _cancel_generates(stub, rng)
            await asyncio.wait_for(_cancel_in_a_session(stub, rng), 60)
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)

    asyncio.run(scenario())
    report = wait_released(pod, "Decode")
    assert (report.num_free_blocks, report.num_running, report.num_waiting) == (
        report.num_total_blocks, 0, 0)
    assert _reserved_gauges(pod) == (0.0, 0.0)

    async def refill():
        async with grpc.aio.insecure_channel(pod.address) as channel:
            return await asyncio.wait_for(
                _reserve_every_slot(pdserve_pb2_grpc.DecodeStub(channel)), 60)

    reserved = asyncio.run(refill())
    assert [r.num_reserved_blocks for r in reserved] == [4] * MAX_NUM_SEQS  # 56 tokens / 16
    report = wait_released(pod, "Decode")
    assert report.num_free_blocks == report.num_total_blocks
    assert _reserved_gauges(pod) == (0.0, 0.0)
