"""ModelRunner logits against the reference, driven through the real scheduler."""

from __future__ import annotations

import pytest
import torch

from engine.reference import reference_greedy, reference_logits
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1100, (n,), generator=g).tolist() for n in lengths]


def _drive(engine, reference_model, steps):
    """Step scheduler + runner by hand, checking every sampled row's logits."""
    checked = 0
    for _ in range(steps):
        plan = engine.scheduler.schedule()
        if not plan.scheduled:
            break
        result = engine.runner.execute(plan.scheduled)
        engine.scheduler.update_computed(plan)
        for request, logits in zip(result.sampling_requests, result.logits, strict=True):
            expected = reference_logits(reference_model, request.all_token_ids)[-1]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
            request.append_output_token(int(logits.argmax()))
            checked += 1
    return checked


@pytest.mark.parametrize("block_size", [16, 128])
def test_logits_match_reference_with_chunks_and_prefix_hits(make_engine, reference_model,
                                                            block_size):
    engine = make_engine(block_size=block_size, num_blocks=4096 // block_size,
                         max_num_batched_tokens=48)
    (shared,) = _prompts([140], seed=11)
    prompts = [shared + [20, 21], *_prompts([5, 60], seed=12)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50))
    checked = _drive(engine, reference_model, steps=8)
    # A later request sharing the 140-token prefix starts from cached blocks.
    engine.add_request("hit", shared + [30, 31, 32], SamplingParams(temperature=0, max_tokens=50))
    checked += _drive(engine, reference_model, steps=4)
    hit = engine._requests["hit"]
    assert hit.num_cached_tokens == (140 // block_size) * block_size
    assert checked >= 12


def test_sliding_window_matches_reference(sliding_model_dir, make_engine):
    from engine.loader import load_model

    model, config = load_model(sliding_model_dir, dtype="float32")
    assert config.sliding_window == 20
    engine = make_engine(model_dir=str(sliding_model_dir), max_num_batched_tokens=24)
    prompts = _prompts([45, 8], seed=13)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = engine.generate(prompts, params)
    for p, r in zip(prompts, results, strict=True):
        assert list(r.token_ids) == reference_greedy(model, p, 10)


@pytest.mark.parametrize("kernel_backend", ["auto", "torch"])
def test_pure_decode_step_fused_attention_equals_the_split_path(make_engine, kernel_backend):
    """A pure-decode step hands each layer's qkv to the context whole
    (`attend_qkv`: one fused call); its logits and cache writes equal the
    split path's (RoPE, inject, attend) bit for bit in float32."""
    import copy
    import dataclasses

    engine = make_engine(kernel_backend=kernel_backend)
    for i, p in enumerate(_prompts([30, 5, 17], seed=21)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8))
    for _ in range(3):
        engine.step()
    plan = engine.scheduler.schedule()
    assert [s.num_new_tokens for s in plan.scheduled] == [1, 1, 1]
    step = engine.runner.prepare(plan.scheduled)
    before = [c.clone() for c in engine.kv_caches]
    fused = engine.runner.forward(step).logits
    assert step.context._fused is not None  # the fused path ran
    fused_caches = [c.clone() for c in engine.kv_caches]
    for cache, saved in zip(engine.kv_caches, before, strict=True):
        cache.copy_(saved)
    split_context = copy.copy(step.context)
    split_context.attend_qkv = lambda *args: None  # the model's split path instead
    split = engine.runner.forward(dataclasses.replace(step, context=split_context)).logits
    assert torch.equal(fused, split)
    for got, expected in zip(fused_caches, engine.kv_caches, strict=True):
        assert torch.equal(got, expected)
