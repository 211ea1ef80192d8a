"""`KVExport` as the real engine's LayerKVHook, sending over the real TCP
connector on loopback to a receiver whose listener records what landed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer.base import KVLayout, KVReceiveListener, TransferTarget
from kv_transfer.config import ReceiverConfig
from kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from prefill_service.kv_export import KVExport

pytestmark = pytest.mark.timeout(120)


class Recorder(KVReceiveListener):
    def __init__(self) -> None:
        self.layers: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.first_token: dict[str, int] = {}
        self.failed: dict[str, str] = {}
        self.lock = threading.Lock()

    def on_layer_ready(self, request_id, layer, kv_view):
        with self.lock:
            self.layers.setdefault(request_id, []).append((layer, kv_view.clone()))

    def on_complete(self, request_id, first_token_id):
        self.first_token[request_id] = first_token_id

    def on_failed(self, request_id, reason):
        self.failed[request_id] = reason


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    recorder = Recorder()
    receiver = TcpKVReceiver(ReceiverConfig(capacity_bytes=64 << 20), recorder)
    receiver.start()
    export = KVExport({"tcp": TcpKVSender()})
    # 32-token steps: a 100-token prompt is prefilled (and streamed) in 4 chunks
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), num_blocks=64,
                                    max_num_batched_tokens=32), layer_kv_hook=export)
    yield engine, export, receiver, recorder
    export.close()
    receiver.close()


def _layout(engine: LLMEngine, num_tokens: int) -> KVLayout:
    mc = engine.model_config
    return KVLayout(mc.num_hidden_layers, num_tokens, mc.num_key_value_heads, mc.head_dim,
                    "float32")


def _prefill(engine, export, target, request_id, prompt,
             layout: KVLayout | None = None) -> tuple[int, int, object]:
    layout = layout or _layout(engine, len(prompt))
    if target is not None:
        export.register(request_id, target, layout)
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=4),
                       prefill_only=True)
    steps, first = 0, None
    while first is None:
        steps += 1
        for output in engine.step():
            if output.request_id == request_id and output.new_token_ids:
                first = output
    outcome = None
    if target is not None:
        outcome = export.finish(request_id, first.new_token_ids[0]).result(30)
        export.forget(request_id)
    return steps, first, outcome


def test_layers_stream_in_order_and_prefix_hits_are_sent(setup):
    engine, export, receiver, recorder = setup
    prompt = [(7 * i) % 1000 + 5 for i in range(100)]
    layout = _layout(engine, 100)
    deadline = time.time() + 30
    first_target = receiver.expect("fresh", layout, deadline)
    steps, first, outcome = _prefill(engine, export, first_target, "fresh", prompt)
    assert steps == 4 and outcome.ok and first.num_cached_tokens == 0

    second_prompt = prompt[:96] + [11, 12, 13, 14]
    second_target = receiver.expect("cached", layout, deadline)
    _, second, outcome = _prefill(engine, export, second_target, "cached", second_prompt)
    assert outcome.ok and second.num_cached_tokens == 96

    num_layers = engine.model_config.num_hidden_layers
    for rid, token in (("fresh", first.new_token_ids[0]), ("cached", second.new_token_ids[0])):
        assert [layer for layer, _ in recorder.layers[rid]] == list(range(num_layers))
        assert recorder.first_token[rid] == token
    for (_, a), (_, b) in zip(recorder.layers["fresh"], recorder.layers["cached"], strict=True):
        assert a.shape == (2, 100, 2, 64)
        # the cached 96 tokens were sent from the prefix cache, bit for bit
        assert torch.equal(a[:, :96], b[:, :96])
        assert not torch.equal(a[:, 96:], b[:, 96:])
        assert a.abs().sum() > 0
    receiver.release("fresh")
    receiver.release("cached")


def test_only_tokens_after_the_layout_offset_are_sent(setup):
    """The decode pod holds a prefix: offsets inside a 32-token chunk, at a
    chunk's edge and in the last chunk of a fresh (4-chunk) prefill; the rows
    that land are the whole context's rows (sent next, from the prefix
    cache, which the test above shows is bit for bit) from the offset on."""
    engine, export, receiver, recorder = setup
    deadline = time.time() + 30
    num_layers = engine.model_config.num_hidden_layers
    for offset in (40, 64, 99):
        prompt = [(13 * i + offset) % 1000 + 5 for i in range(100)]
        tail, whole = f"tail-{offset}", f"whole-{offset}"
        layout = _layout(engine, 100 - offset)
        layout = KVLayout(layout.num_layers, layout.num_tokens, layout.num_kv_heads,
                          layout.head_dim, layout.dtype, token_offset=offset)
        steps, _, outcome = _prefill(engine, export, receiver.expect(tail, layout, deadline),
                                     tail, prompt, layout)
        assert steps == 4 and outcome.ok, outcome
        target = receiver.expect(whole, _layout(engine, 100), deadline)
        assert _prefill(engine, export, target, whole, prompt)[2].ok
        assert [layer for layer, _ in recorder.layers[tail]] == list(range(num_layers))
        for (_, all_rows), (_, rows) in zip(recorder.layers[whole], recorder.layers[tail],
                                            strict=True):
            assert rows.shape == (2, 100 - offset, 2, 64)
            assert torch.equal(rows, all_rows[:, offset:])
        receiver.release(tail)
        receiver.release(whole)


def test_unreachable_target_fails_the_outcome_not_the_engine(setup):
    engine, export, _, _ = setup
    target = TransferTarget(endpoints=("127.0.0.1:1",), ticket=b"t", transport="tcp",
                            generation=1, deadline=time.time() + 5)
    _, first, outcome = _prefill(engine, export, target, "nowhere", [5] * 40)
    assert not outcome.ok
    assert outcome.reason.startswith("connect")
    # the engine keeps serving (no target: prefill only)
    _, again, _ = _prefill(engine, export, None, "plain", [6] * 40)
    assert len(again.new_token_ids) == 1


def test_register_refuses_a_transport_without_sender(setup):
    _, export, _, _ = setup
    target = TransferTarget(endpoints=("127.0.0.1:1",), ticket=b"t", transport="grpc",
                            generation=1, deadline=time.time() + 5)
    with pytest.raises(ValueError, match="target transport 'grpc' is not available on this "
                                         r"prefill pod \(available: tcp\)"):
        export.register("g", target, KVLayout(2, 4, 2, 64, "float32"))
