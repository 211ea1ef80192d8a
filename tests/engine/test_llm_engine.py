"""LLMEngine against the no-cache reference (float32, CPU, tiny model)."""

from __future__ import annotations

import pytest
import torch

from engine.reference import reference_greedy
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    # ids >= 10 keep the special tokens (bos 0, eos 1 and 4) out of prompts
    return [torch.randint(10, 1100, (n,), generator=g).tolist() for n in lengths]


def _run(engine, requests):
    """Add (id, prompt, params) requests, step to the end, return id -> (tokens, reason)."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    tokens = {request_id: [] for request_id, _, _ in requests}
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def _expect(reference_model, engine, prompt, max_tokens):
    return reference_greedy(reference_model, prompt, max_tokens, tuple(engine.eos_token_ids))


@pytest.mark.parametrize("block_size", [16, 128])
def test_greedy_mixed_batch_matches_reference(make_engine, reference_model, block_size):
    engine = make_engine(block_size=block_size, num_blocks=2048 // block_size)
    prompts = _prompts([3, 17, 40, 150])  # one block, two blocks, several blocks
    got = _run(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        expected = _expect(reference_model, engine, p, 6)
        assert got[f"r{i}"][0] == expected
        assert got[f"r{i}"][1] == ("stop" if len(expected) < 6 else "length")
    assert engine.stats().num_free_blocks == 2048 // block_size


def test_chunked_prefill_matches_reference(make_engine, reference_model):
    engine = make_engine(max_num_batched_tokens=16)
    prompts = _prompts([70, 5, 33], seed=1)
    got = _run(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[f"r{i}"][0] == _expect(reference_model, engine, p, 6)


def test_prefix_cache_hit_matches_reference(make_engine, reference_model):
    engine = make_engine(block_size=16)
    (shared,) = _prompts([50], seed=2)
    first = shared + [11, 12]
    second = shared + [13, 14, 15]
    _run(engine, [("a", first, GREEDY)])
    engine.add_request("b", second, GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[0].num_cached_tokens == 48  # 3 full blocks of the shared 50 tokens
    assert [t for o in outputs for t in o.new_token_ids] == _expect(
        reference_model, engine, second, 6)
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (3 + 3, 3)


def test_prefix_caching_off_never_hits(make_engine):
    engine = make_engine(enable_prefix_caching=False)
    (p,) = _prompts([40], seed=3)
    _run(engine, [("a", p, GREEDY)])
    engine.add_request("b", p, GREEDY)
    assert engine.step()[0].num_cached_tokens == 0


def test_preemption_matches_reference(make_engine, reference_model):
    # 6 blocks of 16 slots: three 30-token prompts growing by 12 cannot all fit.
    engine = make_engine(num_blocks=6, block_size=16)
    prompts = _prompts([30, 30, 30], seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = _run(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert engine.stats().num_preemptions > 0
    for i, p in enumerate(prompts):
        # ignore_eos: compare with an eos-free reference of the same length
        assert got[f"r{i}"] == (reference_greedy(reference_model, p, 12), "length")
    assert engine.stats().num_free_blocks == 6


def test_seeded_sampling_same_alone_in_batch_and_across_preemption(make_engine):
    (p,) = _prompts([30], seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    alone = _run(make_engine(), [("s", p, params)])["s"][0]
    others = _prompts([30, 30], seed=6)
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = [("x", others[0], noisy), ("s", p, params), ("y", others[1], noisy)]
    assert _run(make_engine(), batch)["s"][0] == alone
    tight = make_engine(num_blocks=6, block_size=16)
    assert _run(tight, batch)["s"][0] == alone
    assert tight.stats().num_preemptions > 0
    assert len(set(alone)) > 1


def test_stop_token_ids_and_logprobs(make_engine, reference_model):
    engine = make_engine()
    (p,) = _prompts([20], seed=7)
    expected = _expect(reference_model, engine, p, 6)
    stop_at = expected[2]
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(stop_at,), logprobs=2)
    engine.add_request("r", p, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == expected[: expected.index(stop_at) + 1]
    assert outputs[-1].finish_reason == "stop"
    first = outputs[0].new_logprobs[0]
    assert first.token_id == tokens[0] and first.top_token_ids[0] == tokens[0]
    assert len(first.top_logprobs) == 2 and first.logprob == first.top_logprobs[0]


def test_prefill_only_finishes_after_first_token_and_keeps_prefix_cached(make_engine):
    engine = make_engine()
    (p,) = _prompts([40], seed=8)
    engine.add_request("p", p, SamplingParams(temperature=0, max_tokens=5), prefill_only=True)
    (out,) = engine.step()
    assert out.finish_reason == "prefill_done" and len(out.new_token_ids) == 1
    assert not engine.has_unfinished_requests() and engine.stats().num_free_blocks == 64
    engine.add_request("again", p, GREEDY)
    assert engine.step()[0].num_cached_tokens == 32


def _in_state(request, state):
    status = request.status.name
    prefilled = request.num_computed_tokens >= request.num_context_tokens
    return {
        "waiting": status == "WAITING",
        "prefilling": status == "RUNNING" and 0 < request.num_computed_tokens and not prefilled,
        "decoding": status == "RUNNING" and prefilled,
        "preempted": status == "PREEMPTED",
        "reserved": status == "WAITING_FOR_REMOTE_KV",
    }[state]


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted",
                                   "reserved"])
def test_abort_in_every_state_frees_all_blocks(make_engine, state):
    engine = make_engine(num_blocks=6, block_size=16, max_num_batched_tokens=16)
    prompts = _prompts([30, 30, 30], seed=9)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    if state == "reserved":
        engine.reserve_remote("v", prompts[0], params)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    victim = None
    for _ in range(60):
        victim = next((rid for rid, r in engine._requests.items() if _in_state(r, state)), None)
        if victim is not None:
            break
        engine.step()
    assert victim is not None, f"no request reached state {state}"
    assert engine.abort_request(victim) and not engine.abort_request(victim)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finish_reason != "abort" or out.request_id == victim
    assert engine.stats().num_free_blocks == 6
    assert engine.stats().num_running == engine.stats().num_waiting == 0


def test_abort_is_reported_by_the_next_step(make_engine):
    engine = make_engine()
    engine.add_request("a", [20, 21, 22], GREEDY)
    assert engine.abort_request("a")
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason, out.new_token_ids) == ("a", "abort", ())
    assert not engine.abort_request("unknown")


def test_validation_names_the_limit(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="exceeds max_model_len 64"):
        engine.add_request("a", list(range(10, 70)), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="must not be empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match=r"token id 1100 is outside the vocabulary \[0, 1100\)"):
        engine.add_request("a", [5, 1100], SamplingParams())
    with pytest.raises(ValueError, match="KV blocks"):
        make_engine(num_blocks=2).add_request("a", list(range(10, 40)), SamplingParams())
    engine.add_request("a", [5, 6], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [5, 6], SamplingParams())
    with pytest.raises(ValueError, match="max_position_embeddings 4096"):
        make_engine(max_model_len=5000)


def test_generate_honours_stop_strings(make_engine):
    engine = make_engine()
    prompts = _prompts([12, 25], seed=10)
    plain = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True))
    assert all(r.finish_reason == "length" and len(r.token_ids) == 8 for r in plain)
    text = plain[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=8,
                                                   ignore_eos=True, stop=(stop,)),
                                    SamplingParams(temperature=0, max_tokens=8,
                                                   ignore_eos=True)])
    assert cut[0].finish_reason == "stop" and cut[0].text == text[: text.find(stop)]
    assert cut[0].token_ids == plain[0].token_ids[: len(cut[0].token_ids)]
    assert cut[1].text == plain[1].text and cut[1].finish_reason == "length"
    assert engine.stats().num_free_blocks == 64


def test_triton_kernels_in_the_engine_match_reference(make_engine, reference_model):
    """The same engine path with the Triton kernels (interpreted on CPU)."""
    import kernels

    if not kernels.triton_available():
        pytest.skip("triton is not installed")
    engine = make_engine(block_size=16, max_num_batched_tokens=24, kernel_backend="triton")
    prompts = _prompts([20, 5], seed=14)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    got = _run(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == (reference_greedy(reference_model, p, 3), "length")


def test_short_prompts_first_matches_reference(make_engine, reference_model):
    """`short_prefill_tokens` reorders admission (a cached next turn and short
    prompts go before long prompts' chunks); every output still equals the
    reference."""
    engine = make_engine(block_size=16, max_num_batched_tokens=32, short_prefill_tokens=12)
    (history,) = _prompts([48], seed=5)
    _run(engine, [("turn-1", history, GREEDY)])
    long_a, long_b, short = _prompts([90, 70, 6], seed=6)
    requests = [("long-a", long_a, GREEDY), ("long-b", long_b, GREEDY),
                ("turn-2", history + [21, 22, 23], GREEDY), ("short", short, GREEDY)]
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    tokens = {request_id: [] for request_id, _, _ in requests}
    first_step = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.new_token_ids:
                first_step.setdefault(out.request_id, step)
            tokens[out.request_id].extend(out.new_token_ids)
    for request_id, prompt, _ in requests:
        assert tokens[request_id] == _expect(reference_model, engine, prompt, 6), request_id
    # the cached turn and the short prompt had their first token before either long prompt
    assert max(first_step["turn-2"], first_step["short"]) < min(first_step["long-a"],
                                                                first_step["long-b"])
