"""The LayerKVHook sees every layer of every context token exactly once, with the right KV."""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.kv_hook import LayerKVSpan
from engine.reference import DenseCausalContext
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


class RecordingHook:
    """Copies each span's KV out of the cache during the call, as a sender must."""

    def __init__(self):
        self.calls = []  # (layer, ((request_id, start, end), ...))
        self.kv = {}  # (request_id, layer) -> {position: [2, Hkv, D]}

    def on_layer_kv(self, layer_idx, kv_cache_layer, spans):
        self.calls.append((layer_idx, tuple((s.request_id, s.start, s.end) for s in spans)))
        for span in spans:
            rows = kernels.extract_kv(kv_cache_layer, span.slot_mapping).clone()
            store = self.kv.setdefault((span.request_id, layer_idx), {})
            for i in range(span.num_tokens):
                assert span.start + i not in store, "token streamed twice"
                store[span.start + i] = rows[:, i]


class KVRecordingContext(DenseCausalContext):
    def __init__(self, model):
        super().__init__(scale=model.config.head_dim**-0.5)
        self.kv = {}

    def attend(self, layer_idx, q, k, v):
        self.kv[layer_idx] = torch.stack((k, v))
        return super().attend(layer_idx, q, k, v)


def _reference_kv(model, token_ids):
    ctx = KVRecordingContext(model)
    ids = torch.tensor(token_ids)
    model(ids, torch.arange(len(token_ids)), ctx)
    return ctx.kv


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1100, (n,), generator=g).tolist() for n in lengths]


def _check(engine, hook, reference_model, requests, num_layers):
    # Calls come in runs of 0..L-1, one run per step that computed context tokens.
    layers = [layer for layer, _ in hook.calls]
    assert layers == list(range(num_layers)) * (len(layers) // num_layers)
    for step in range(len(layers) // num_layers):
        run = hook.calls[step * num_layers : (step + 1) * num_layers]
        assert len({spans for _, spans in run}) == 1  # same spans for every layer
    for rid, prompt, _, _ in requests:
        ref = _reference_kv(reference_model, prompt)
        for layer in range(num_layers):
            store = hook.kv[(rid, layer)]
            assert sorted(store) == list(range(len(prompt)))
            got = torch.stack([store[i] for i in range(len(prompt))], dim=1)
            torch.testing.assert_close(got, ref[layer], atol=1e-5, rtol=0)


def test_spans_cover_chunks_and_prefix_hits_once(make_engine, reference_model):
    hook = RecordingHook()
    engine = make_engine(block_size=16, max_num_batched_tokens=32, layer_kv_hook=hook)
    (shared,) = _prompts([50], seed=20)
    requests = [("a", shared + [11] * 20, SamplingParams(temperature=0, max_tokens=3), True),
                ("c", _prompts([9], seed=21)[0], SamplingParams(temperature=0, max_tokens=6),
                 False)]
    for rid, prompt, params, prefill_only in requests:
        engine.add_request(rid, prompt, params, prefill_only=prefill_only)
    while engine.has_unfinished_requests():
        engine.step()
    b = ("b", shared + [12] * 10, SamplingParams(temperature=0, max_tokens=3), True)
    engine.add_request(b[0], b[1], b[2], prefill_only=True)
    (out,) = engine.step()
    assert out.num_cached_tokens == 48
    # b's only span starts at 0 although 48 tokens were prefix hits.
    assert hook.calls[-1][1] == (("b", 0, 60),)
    _check(engine, hook, reference_model, [*requests, b], engine.model_config.num_hidden_layers)
    spans_a = [spans for layer, spans in hook.calls if layer == 0 and spans[0][0] == "a"]
    assert [s[0] for s in spans_a] == [("a", 0, 32), ("a", 32, 64), ("a", 64, 70)]


def test_spans_exactly_once_across_preemption(make_engine, reference_model):
    hook = RecordingHook()
    engine = make_engine(num_blocks=6, block_size=16, max_num_batched_tokens=16,
                         layer_kv_hook=hook)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = [(f"r{i}", p, params, False) for i, p in enumerate(_prompts([30] * 3, seed=22))]
    for rid, prompt, p, _ in requests:
        engine.add_request(rid, prompt, p)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_preemptions > 0
    _check(engine, hook, reference_model, requests, engine.model_config.num_hidden_layers)


def test_span_validation():
    with pytest.raises(ValueError, match="non-empty"):
        LayerKVSpan("r", 3, 3, torch.empty(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape"):
        LayerKVSpan("r", 0, 2, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        LayerKVSpan("r", 0, 2, torch.zeros(2, dtype=torch.int32))
