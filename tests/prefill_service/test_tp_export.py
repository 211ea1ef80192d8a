"""Every rank of a prefill pod sends its own KV heads (prefill_service/
kv_export.py on rank 0, rank_export.py on the worker): a real TP=2 engine
(a worker process, gloo) and a TP=1 one, the tiny model (2 KV heads,
float32), sending over the real TCP connector (and once over gRPC) on
loopback to receivers set up as a decode pod at TP=1 (one receiver, the
whole-model layout) or at TP=2 would (two receivers sharing the ticket
secret and generation, each expecting its head's share). What lands is
compared head for head with what a TP=1 prefill of the same prompt sends:
within the TP tolerance of docs/tensor_parallel.md (rtol = atol = 1e-4; a
sharded forward sums in another order), bit for bit where both sides are
TP=1's own cache."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.shard import kv_head_range
from engine.sampling_params import SamplingParams
from kv_transfer.base import KVLayout, KVReceiveListener, RankTarget, TransferTarget
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.grpc import GrpcKVReceiver
from kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from prefill_service.kv_export import KVExport
from prefill_service.rank_export import RANK_SERVICE
from prefill_service.senders import make_senders
from prefill_service.worker_exports import WorkerExports

pytestmark = pytest.mark.timeout(300)

SECRET = b"tp-export-test-secret-0123456789"
GENERATION = 4242
TOL = dict(rtol=1e-4, atol=1e-4)  # docs/tensor_parallel.md, "Tolerance"
SENDER = SenderConfig(num_streams=2)


class Recorder(KVReceiveListener):
    def __init__(self) -> None:
        self.layers: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.first_token: dict[str, int] = {}
        self.failed: dict[str, str] = {}
        self.lost: dict[str, str] = {}  # on_restart: the attempt went away (ABORT)
        self.changed = threading.Condition()

    def on_layer_ready(self, request_id, layer, kv_view):
        with self.changed:
            self.layers.setdefault(request_id, []).append((layer, kv_view.clone()))

    def on_complete(self, request_id, first_token_id):
        with self.changed:
            self.first_token[request_id] = first_token_id
            self.changed.notify_all()

    def on_failed(self, request_id, reason):
        with self.changed:
            self.failed[request_id] = reason
            self.changed.notify_all()

    def on_restart(self, request_id, reason):
        with self.changed:
            self.lost[request_id] = reason
            self.changed.notify_all()

    def wait_lost(self, request_id: str, timeout: float = 20.0) -> str:
        """The sender's ABORT: the receiver drops the attempt (and would wait
        for another until the deadline; the decode pod cancels it)."""
        with self.changed:
            assert self.changed.wait_for(lambda: request_id in self.lost, timeout), \
                f"{request_id}'s attempt was not dropped here"
            return self.lost[request_id]


class DecodePod:
    """The KV receivers of a decode pod at TP=len(receivers), one per rank."""

    def __init__(self, size: int, transport: str = "tcp") -> None:
        self.recorders = [Recorder() for _ in range(size)]
        receiver_class = TcpKVReceiver if transport == "tcp" else GrpcKVReceiver
        self.receivers = [receiver_class(ReceiverConfig(
            capacity_bytes=64 << 20, secret=SECRET, generation=GENERATION), recorder)
            for recorder in self.recorders]
        for receiver in self.receivers:
            receiver.start()

    def expect(self, request_id: str, layout: KVLayout) -> TransferTarget:
        """As a decode pod's rank 0 fills `Reserved`: each rank expects its
        heads' share (TP=1: the whole-model layout), one ticket for all."""
        deadline = time.time() + 60
        size, heads = len(self.receivers), layout.num_kv_heads
        if size == 1:
            return self.receivers[0].expect(request_id, layout, deadline)
        ranges = [kv_head_range(heads, d, size) for d in range(size)]
        targets = [r.expect(request_id, layout.head_share(*ranges[d]), deadline)
                   for d, r in enumerate(self.receivers)]
        first = targets[0]
        return TransferTarget(first.endpoints, first.ticket, first.transport, first.generation,
                              deadline,
                              ranks=tuple(RankTarget(t.endpoints, *ranges[d])
                                          for d, t in enumerate(targets)),
                              tensor_parallel_size=size)

    def bytes_received(self) -> int:
        return sum(r.stats().bytes_received for r in self.receivers)

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


@pytest.fixture(scope="module")
def pods(tiny_model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two ranks share this machine's cores
    decode1, decode2, decode_grpc = DecodePod(1), DecodePod(2), DecodePod(2, "grpc")
    common = dict(model_dir=str(tiny_model_dir), dtype="float32", num_blocks=64,
                  block_size=16, max_num_batched_tokens=32)  # a 100-token prompt: 4 steps
    ref_export = KVExport({"tcp": TcpKVSender(SENDER)},
                          more_senders=lambda: {"tcp": TcpKVSender(SENDER)})
    ref = LLMEngine(EngineConfig(**common), layer_kv_hook=ref_export)
    tp_export = KVExport(make_senders(2), prefill_tp=2)  # as the pod's: tcp and grpc
    tp = LLMEngine(EngineConfig(**common, tensor_parallel_size=2, tp_timeout_s=30.0,
                                rank_service=RANK_SERVICE), layer_kv_hook=tp_export)
    workers = WorkerExports(tp.tp, num_streams=2)
    tp_export.attach_workers(workers)
    yield dict(ref=(ref, ref_export), tp=(tp, tp_export), workers=workers,
               decode1=decode1, decode2=decode2, decode_grpc=decode_grpc)
    for engine, export in ((tp, tp_export), (ref, ref_export)):
        engine.close()
        export.close()
    for decode in (decode1, decode2, decode_grpc):
        decode.close()
    torch.set_num_threads(threads)


def _layout(engine: LLMEngine, num_tokens: int) -> KVLayout:
    mc = engine.model_config
    return KVLayout(mc.num_hidden_layers, num_tokens, mc.num_key_value_heads, mc.head_dim,
                    "float32")


def _prefill(engine_export, decode: DecodePod, request_id: str, prompt: list[int]
             ) -> tuple[int, int]:
    """Prefill `prompt` exporting to `decode`; (first token, bytes landed)."""
    engine, export = engine_export
    before = decode.bytes_received()
    export.register(request_id, decode.expect(request_id, _layout(engine, len(prompt))),
                    _layout(engine, len(prompt)))
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=4),
                       prefill_only=True)
    first = None
    while first is None:
        for output in engine.step():
            if output.request_id == request_id and output.new_token_ids:
                first = output.new_token_ids[0]
    outcome = export.finish(request_id, first).result(30)
    export.forget(request_id)
    assert outcome.ok, outcome
    for recorder in decode.recorders:
        assert recorder.first_token[request_id] == first
    return first, decode.bytes_received() - before


def _landed(decode: DecodePod, rank: int, request_id: str) -> list[torch.Tensor]:
    layers = decode.recorders[rank].layers[request_id]
    assert [layer for layer, _ in layers] == list(range(len(layers)))  # in layer order
    return [kv for _, kv in layers]


def _prompt(seed: int) -> list[int]:
    return [(7 * i + 31 * seed) % 1000 + 5 for i in range(100)]


def test_tp2_prefill_to_tp1_decode_lands_tp1s_kv(pods):
    """Two senders (rank 0 head 0, the worker head 1) write one head-ranged
    layout over both heads into the one receiver."""
    decode = pods["decode1"]
    prompt = _prompt(1)
    first_ref, bytes_ref = _prefill(pods["ref"], decode, "ref-1", prompt)
    first_tp, bytes_tp = _prefill(pods["tp"], decode, "tp-1", prompt)
    assert first_tp == first_ref
    assert bytes_tp == bytes_ref == _layout(pods["ref"][0], 100).total_bytes
    ref, got = _landed(decode, 0, "ref-1"), _landed(decode, 0, "tp-1")
    assert len(got) == len(ref) == 2
    for a, b in zip(ref, got, strict=True):
        assert b.shape == a.shape == (2, 100, 2, 64)
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, **TOL)
        assert not torch.equal(b[:, :, 0], b[:, :, 1])  # each head its own bytes


def test_tp2_prefill_to_tp2_decode_each_rank_gets_its_head(pods):
    prompt = _prompt(2)
    _, bytes_ref = _prefill(pods["ref"], pods["decode1"], "ref-2", prompt)
    _, bytes_tp = _prefill(pods["tp"], pods["decode2"], "tp-2", prompt)
    assert bytes_tp == bytes_ref  # the same bytes in all, split between the ranks
    assert [r.stats().bytes_received for r in pods["decode2"].receivers] == [bytes_ref // 2] * 2
    ref = _landed(pods["decode1"], 0, "ref-2")
    for rank in (0, 1):
        for a, b in zip(ref, _landed(pods["decode2"], rank, "tp-2"), strict=True):
            assert b.shape == (2, 100, 1, 64)
            torch.testing.assert_close(b, a[:, :, rank:rank + 1], **TOL)


def test_tp2_prefill_to_tp2_decode_over_grpc(pods):
    """The same over the gRPC transport (the worker's senders come from the
    pod's `make_senders`, SETUP's stream count)."""
    prompt = _prompt(8)
    _, bytes_ref = _prefill(pods["ref"], pods["decode1"], "ref-8", prompt)
    _, bytes_tp = _prefill(pods["tp"], pods["decode_grpc"], "grpc-8", prompt)
    assert bytes_tp == bytes_ref
    ref = _landed(pods["decode1"], 0, "ref-8")
    for rank in (0, 1):
        for a, b in zip(ref, _landed(pods["decode_grpc"], rank, "grpc-8"), strict=True):
            torch.testing.assert_close(b, a[:, :, rank:rank + 1], **TOL)


def test_tp1_prefill_to_tp2_decode_splits_its_heads(pods):
    """One prefill rank, two decode ranks: two transfers of one request from
    one rank (two sender sets); from TP=1's cache, so bit for bit."""
    prompt = _prompt(3)
    _, bytes_ref = _prefill(pods["ref"], pods["decode1"], "ref-3", prompt)
    _, bytes_split = _prefill(pods["ref"], pods["decode2"], "split-3", prompt)
    assert bytes_split == bytes_ref
    ref = _landed(pods["decode1"], 0, "ref-3")
    for rank in (0, 1):
        for a, b in zip(ref, _landed(pods["decode2"], rank, "split-3"), strict=True):
            assert torch.equal(b, a[:, :, rank:rank + 1])


def test_abort_mid_transfer_frees_every_rank(pods):
    engine, export = pods["tp"]
    decode = pods["decode2"]
    prompt = _prompt(4)
    layout = _layout(engine, len(prompt))
    export.register("abort-4", decode.expect("abort-4", layout), layout)
    engine.add_request("abort-4", prompt, SamplingParams(temperature=0.0, max_tokens=4),
                       prefill_only=True)
    engine.step()  # the first 32 tokens computed (and on their way) on both ranks
    assert engine.step() == []  # and the next chunk: still no first token
    assert pods["workers"].open_requests() == {1: ["abort-4"]}
    export.abort("abort-4", "client went away")
    assert engine.abort_request("abort-4")
    export.forget("abort-4")
    while engine.has_unfinished_requests():
        engine.step()
    for recorder in decode.recorders:  # both decode ranks were told, by their senders
        assert recorder.wait_lost("abort-4") == "sender_lost: aborted: client went away"
        assert "abort-4" not in recorder.first_token
    assert export.open_requests == ()
    assert pods["workers"].open_requests() == {1: []}
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks
    # and the pod serves on
    _, landed = _prefill(pods["tp"], decode, "after-4", _prompt(5))
    assert landed == layout.total_bytes


def test_a_workers_failed_part_fails_the_request_with_its_reason(pods):
    """Decode rank 1 (head 1, the worker's) cannot be reached: the worker's
    OUTCOME fails rank 0's verdict, naming the rank, whatever rank 0's own
    part did; the pod serves on."""
    engine, export = pods["tp"]
    prompt = _prompt(6)
    layout = _layout(engine, len(prompt))
    good = pods["decode2"].expect("unreachable-6", layout)
    ranks = (good.ranks[0], RankTarget(("127.0.0.1:1",), 1, 2))
    target = TransferTarget(good.endpoints, good.ticket, "tcp", good.generation, good.deadline,
                            ranks=ranks, tensor_parallel_size=2)
    export.register("unreachable-6", target, layout)
    engine.add_request("unreachable-6", prompt, SamplingParams(temperature=0.0, max_tokens=4),
                       prefill_only=True)
    first = None
    while first is None:
        for output in engine.step():
            if output.new_token_ids:
                first = output.new_token_ids[0]
    outcome = export.finish("unreachable-6", first).result(30)
    export.forget("unreachable-6")
    assert not outcome.ok
    assert outcome.reason.startswith("connect"), outcome.reason
    assert outcome.reason.endswith("(from tensor-parallel rank 1)")
    assert pods["workers"].open_requests() == {1: []}
    _, landed = _prefill(pods["tp"], pods["decode2"], "after-6", _prompt(7))
    assert landed == layout.total_bytes
