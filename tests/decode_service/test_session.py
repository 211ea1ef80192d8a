"""Decode.Session on a real colocated pod process (tiny model): one batch per
engine step for all of a session's requests, outputs equal to Decode.Generate,
a bad request's error and a cancel affect only that request."""

from __future__ import annotations

import queue

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.pods import start_pod

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pod(tiny_model_dir):
    process = start_pod("colocated", tiny_model_dir, max_num_seqs=8)
    yield process
    process.kill()


def _request(rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> pb.DecodeGenerateRequest:
    return pb.DecodeGenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                    sampling=pb.SamplingParams(max_tokens=max_tokens, top_p=1.0,
                                                               ignore_eos=True))


def _generate(stub, rid: str, prompt: list[int]) -> list[int]:
    return [t for m in stub.Generate(_request(rid, prompt), timeout=60)
            for t in m.tokens.token_ids]


class _Session:
    """A Session whose commands are fed from a queue (None half-closes)."""

    def __init__(self, stub) -> None:
        self.commands: queue.Queue = queue.Queue()
        self.call = stub.Session(iter(self.commands.get, None), timeout=120)

    def send(self, **kind) -> None:
        self.commands.put(pb.SessionCommand(**kind))

    def close(self) -> None:
        self.commands.put(None)


def test_one_batch_per_step_and_outputs_equal_generate(pod):
    with grpc.insecure_channel(pod.address) as channel:
        stub = pdserve_pb2_grpc.DecodeStub(channel)
        reference = {f"r{i}": _generate(stub, f"ref{i}", p) for i, p in enumerate(PROMPTS)}
        session = _Session(stub)
        for i, prompt in enumerate(PROMPTS):
            session.send(generate=_request(f"r{i}", prompt))
        tokens: dict[str, list[int]] = {rid: [] for rid in reference}
        finished: set[str] = set()
        batches = 0
        for batch in session.call:
            batches += 1
            for event in batch.events:
                assert event.WhichOneof("kind") == "tokens"
                assert event.tokens.first_index == len(tokens[event.request_id])
                tokens[event.request_id].extend(event.tokens.token_ids)
                if event.tokens.finish_reason:
                    assert event.tokens.finish_reason == "length"
                    finished.add(event.request_id)
            if finished == set(reference):
                session.close()
        assert tokens == reference
        # every request produced MAX_TOKENS tokens, one per step: with one
        # message per request and token there would be 4 x MAX_TOKENS batches;
        # a step's outputs share a batch (slack: requests admitted a step apart)
        assert batches <= MAX_TOKENS + len(PROMPTS), batches


def test_an_error_and_a_cancel_touch_only_their_request(pod):
    with grpc.insecure_channel(pod.address) as channel:
        stub = pdserve_pb2_grpc.DecodeStub(channel)
        reference = _generate(stub, "ref-keep", PROMPTS[0])
        session = _Session(stub)
        session.send(generate=_request("keep", PROMPTS[0]))
        session.send(generate=_request("victim", PROMPTS[1], max_tokens=3000))
        session.send(generate=_request("bad", PROMPTS[2], max_tokens=-1))
        events: dict[str, list[pb.SessionEvent]] = {"keep": [], "victim": [], "bad": []}
        cancelled_at = None
        for batch in session.call:
            for event in batch.events:
                events[event.request_id].append(event)
            victim_tokens = sum(len(e.tokens.token_ids) for e in events["victim"])
            if cancelled_at is None and victim_tokens >= 5:
                session.send(cancel="victim")
                cancelled_at = victim_tokens
            keep = events["keep"]
            if keep and keep[-1].tokens.finish_reason:
                session.close()
        (bad,) = events["bad"]
        assert bad.WhichOneof("kind") == "error"
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "max_tokens" in bad.error.message
        assert [t for e in events["keep"] for t in e.tokens.token_ids] == reference
        victim_tokens = sum(len(e.tokens.token_ids) for e in events["victim"])
        assert cancelled_at is not None and victim_tokens < 3000
        assert not any(e.tokens.finish_reason for e in events["victim"])
        load = stub.GetLoad(pb.LoadRequest(), timeout=10)
        assert load.num_running == 0 and load.num_free_blocks == load.num_total_blocks
