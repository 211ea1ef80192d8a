"""The control channel of a tensor-parallel pod (engine/parallel/control.py):
the message codec; then real worker processes (gloo on CPU, the tiny
model) running `echo_service` by name: READY before anyone listened,
messages both ways with their JSON fields and raw payloads, a step ordered
after the control messages sent before it (the worker's forward waits for
a slow one), a worker's hook seeing the very spans rank 0's hook sees
(request ids, starts, ends, slots), and a service that fails taking the pod
down instead of hanging it."""

from __future__ import annotations

import queue
import socket
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.control import ControlError, WorkerControl, encode, receive
from engine.parallel.launch import TensorParallelError
from engine.sampling_params import SamplingParams
from tests.engine.parallel.echo_service import Kind, span_record

pytestmark = pytest.mark.timeout(180)

SERVICE = "tests.engine.parallel.echo_service:start"
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread_per_rank():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Rank0Hook:
    def __init__(self) -> None:
        self.spans: list[list] = []

    def on_layer_kv(self, layer_idx, kv_cache_layer, spans) -> None:
        if layer_idx == 0:
            self.spans += [span_record(s) for s in spans]


def _engine(tiny_model_dir, hook=None, size=4) -> tuple[LLMEngine, queue.Queue]:
    engine = LLMEngine(EngineConfig(
        model_dir=str(tiny_model_dir), dtype="float32", num_blocks=64, block_size=16,
        max_num_batched_tokens=32, tensor_parallel_size=size, tp_timeout_s=30.0,
        rank_service=SERVICE), layer_kv_hook=hook)
    replies: queue.Queue = queue.Queue()
    engine.tp.on_control(lambda rank, kind, fields, payload: replies.put(
        (rank, kind, fields, payload)))
    return engine, replies


def _take(replies: queue.Queue, n: int) -> list:
    return sorted((replies.get(timeout=30) for _ in range(n)), key=lambda m: m[0])


def test_codec_round_trip_and_refusals():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(encode(7, {"a": [1, 2], "b": "x"}, b"\x00\x01") + encode(9, {}))
        first, second = receive(theirs), receive(theirs)
        assert (first.kind, first.fields, first.payload) == (7, {"a": [1, 2], "b": "x"},
                                                             b"\x00\x01")
        assert (second.kind, second.fields, second.payload) == (9, {}, b"")
        ours.shutdown(socket.SHUT_WR)
        assert receive(theirs) is None
    with pytest.raises(ValueError, match="kind must be in"):
        encode(70000, {})
    with pytest.raises(TypeError):
        encode(1, {"tensor": torch.zeros(1)})  # only JSON primitives, never pickle


def test_wait_processed_fails_at_end_of_stream_and_timeout():
    ours, theirs = socket.socketpair()
    control = WorkerControl(theirs)
    seen = []

    class Service:
        layer_kv_hook = None

        def on_control(self, kind, fields, payload):
            seen.append(kind)

        def close(self):
            pass

    control.start(Service())
    ours.sendall(encode(1, {}) + encode(2, {}))
    control.wait_processed(2, timeout=10)
    assert seen == [1, 2]
    with pytest.raises(ControlError, match="not processed within"):
        control.wait_processed(3, timeout=0.2)
    ours.close()
    with pytest.raises(ControlError, match="ended after 2 of 3"):
        control.wait_processed(3, timeout=10)


def test_messages_both_ways_and_steps_after_them(tiny_model_dir):
    hook = Rank0Hook()
    engine, replies = _engine(tiny_model_dir, hook)
    try:
        ready = _take(replies, 3)  # sent at start, before on_control: kept for it
        assert [(rank, kind, fields["rank"]) for rank, kind, fields, _ in ready] == [
            (1, Kind.READY, 1), (2, Kind.READY, 2), (3, Kind.READY, 3)]
        assert {m[2]["num_blocks"] for m in ready} == {engine.block_manager.num_total_blocks}
        slots = torch.arange(5, dtype=torch.int64).numpy().tobytes()
        assert engine.tp.control_send(1, Kind.ECHO, {"tag": "e1", "v": [1.5, None]}, slots) == 1
        assert engine.tp.control_send(2, Kind.ECHO, {"tag": "e2"}) == 1
        echoes = _take(replies, 2)
        assert echoes[0] == (1, Kind.ECHO, {"tag": "e1", "v": [1.5, None], "rank": 1},
                             slots[::-1])
        assert echoes[1] == (2, Kind.ECHO, {"tag": "e2", "rank": 2}, b"")
        # rank 1 applies a slow message; the next step must wait for it there
        engine.tp.control_send(1, Kind.SLOW, {"tag": "slow", "sleep_s": 1.0})
        prompts = [list(range(10, 50)), list(range(60, 67))]
        engine.generate(prompts, GREEDY)
        assert engine.tp.control_sent == (2, 1, 0)
        for rank in (1, 2, 3):
            engine.tp.control_send(rank, Kind.REPORT, {"tag": "report"})
        reports = _take(replies, 3)
        for rank, kind, fields, _ in reports:
            assert kind == Kind.REPORT
            spans = fields["spans"]
            # every span rank 0's hook saw, request ids, starts, ends and slots alike
            assert [s[:4] for s in spans] == hook.spans
            assert all("slow" in s[4] for s in spans) == (rank == 1)
        # the 40-token prompt in chunks of the 32-token budget, then the other
        assert [s[:3] for s in hook.spans] == [
            ["generate-0", 0, 32], ["generate-0", 32, 40], ["generate-1", 0, 7]]
        assert hook.spans[2][3] == list(range(48, 55))  # its own blocks' slots
    finally:
        engine.close()


def test_a_failing_service_takes_the_pod_down_while_idle(tiny_model_dir):
    engine, replies = _engine(tiny_model_dir, size=2)
    try:
        _take(replies, 1)
        engine.tp.control_send(1, Kind.FAIL, {})
        deadline = time.monotonic() + 10  # the worker exits at once: no step needed
        while engine.tp.failure is None:
            assert time.monotonic() < deadline, "the pod did not go down"
            time.sleep(0.05)
        assert "rank 1" in engine.tp.failure and "exit status 1" in engine.tp.failure
        with pytest.raises(TensorParallelError, match="rank 1 .* exited"):
            engine.generate([list(range(10, 30))], GREEDY)
    finally:
        engine.close()
