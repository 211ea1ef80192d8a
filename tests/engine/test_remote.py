"""The decode pod's path: reserve_remote + inject + commit_remote continues
exactly like the colocated engine."""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.errors import CapacityError
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


class CaptureHook:
    """Prefill-side hook: assembles each request's full [2, T, Hkv, D] per layer."""

    def __init__(self):
        self.kv = {}

    def on_layer_kv(self, layer_idx, kv_cache_layer, spans):
        for span in spans:
            rows = kernels.extract_kv(kv_cache_layer, span.slot_mapping).clone()
            self.kv.setdefault((span.request_id, layer_idx), []).append(rows)

    def layer(self, request_id, layer_idx):
        return torch.cat(self.kv[(request_id, layer_idx)], dim=1)


def _finish(engine, request_id):
    tokens, reason = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
                reason = out.finish_reason or reason
    return tokens, reason


def _disaggregated(make_engine, prompt, params, output_token_ids=()):
    hook = CaptureHook()
    prefill = make_engine(block_size=16, max_num_batched_tokens=32, layer_kv_hook=hook)
    prefill.add_request("q", prompt, params, output_token_ids=output_token_ids,
                        prefill_only=True)
    outputs = []
    while prefill.has_unfinished_requests():
        outputs.extend(prefill.step())
    (out,) = outputs  # 75 tokens over 3 chunks; only the last one samples
    assert out.finish_reason == "prefill_done"
    first = out.new_token_ids[0]
    decode = make_engine(block_size=128, num_blocks=8, enable_prefix_caching=False)
    reservation = decode.reserve_remote("q", prompt, params, output_token_ids=output_token_ids)
    context = len(prompt) + len(output_token_ids)
    assert reservation.num_context_tokens == context
    for layer, cache in enumerate(decode.kv_caches):
        kv = hook.layer("q", layer)
        assert kv.shape[1] == context
        kernels.inject_kv(cache, kv, reservation.slot_mapping)
    decode.commit_remote("q", first)
    rest, reason = _finish(decode, "q")
    assert decode.stats().num_free_blocks == 8
    return [first, *rest], reason


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10),
    SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=10, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_reserve_inject_commit_continues_like_colocated(make_engine, params):
    g = torch.Generator().manual_seed(30)
    prompt = torch.randint(10, 1100, (75,), generator=g).tolist()
    colocated = make_engine()
    colocated.add_request("q", prompt, params)
    expected = _finish(colocated, "q")
    assert _disaggregated(make_engine, prompt, params) == expected
    # After a migration at output index 3, both halves resume at that index.
    tokens = expected[0]
    assert len(tokens) == 10
    resumed = _disaggregated(make_engine, prompt, params, output_token_ids=tokens[:3])
    assert resumed == (tokens[3:], expected[1])


def test_commit_whose_first_token_ends_the_request(make_engine):
    engine = make_engine(num_blocks=8)
    engine.reserve_remote("a", [20, 21, 22], SamplingParams(max_tokens=1))
    engine.reserve_remote("b", [20, 21, 22], SamplingParams(max_tokens=5))
    stats = engine.stats()
    assert (stats.num_reserved, stats.num_reserved_blocks) == (2, 2)
    assert not engine.has_unfinished_requests()
    engine.commit_remote("a", 500)
    eos = min(engine.eos_token_ids)
    engine.commit_remote("b", eos)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finish_reason == "length" and outs["a"].new_token_ids == ()
    assert outs["b"].finish_reason == "stop" and outs["b"].num_output_tokens == 1
    assert engine.stats().num_free_blocks == 8 and not engine.has_unfinished_requests()


def test_reservation_capacity_and_state_checks(make_engine):
    engine = make_engine(num_blocks=4, block_size=16, max_num_seqs=2)
    params = SamplingParams(max_tokens=10)
    res = engine.reserve_remote("a", list(range(10, 50)), params)  # 50 tokens -> 4 blocks
    assert res.block_ids == (0, 1, 2, 3) and res.block_size == 16
    assert res.slot_mapping.tolist() == list(range(40))
    with pytest.raises(CapacityError, match="needs 1 KV blocks, 0 are free"):
        engine.reserve_remote("b", [10, 11], params)
    with pytest.raises(ValueError, match="not awaiting remote KV"):
        engine.commit_remote("zzz", 5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.commit_remote("a", 1100)
    assert engine.abort_request("a") and engine.stats().num_free_blocks == 4
    engine.reserve_remote("b", [10], params)
    engine.reserve_remote("c", [10], params)
    with pytest.raises(CapacityError, match="sequence slots"):
        engine.reserve_remote("d", [10], params)
