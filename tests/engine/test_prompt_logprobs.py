"""Prompt logprobs and max_tokens=0 (engine.prompt_logprobs) against the
no-cache reference: log_softmax over the whole prompt's reference logits, on
fresh random prompts, through chunked prefill, the prefix cache, async
scheduling and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from engine.reference import reference_logits
from engine.sampling_params import SamplingParams

ATOL = 1e-4  # float32 paged vs dense attention; top ids must match exactly


def _prompts(lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _reference(model, prompt: list[int], n: int):
    """(logprob of token i, top-n ids, top-n values) for i = 1..P-1."""
    logprobs = reference_logits(model, prompt).log_softmax(dim=-1)
    out = []
    for i in range(1, len(prompt)):
        row = logprobs[i - 1]
        values, ids = row.topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        out.append((row[prompt[i]].item(), ids.tolist(), values.tolist()))
    return out


def _check(entries, prompt: list[int], expected) -> None:
    assert entries is not None and len(entries) == len(prompt) - 1
    for i, (entry, (logprob, ids, values)) in enumerate(zip(entries, expected, strict=True)):
        assert entry.token_id == prompt[i + 1], i
        assert entry.logprob == pytest.approx(logprob, abs=ATOL), i
        assert list(entry.top_token_ids) == ids, i
        assert list(entry.top_logprobs) == pytest.approx(values, abs=ATOL), i


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill: each chunk scores its positions
    {"max_num_batched_tokens": 16, "async_scheduling": True},
    {"enable_prefix_caching": True, "block_size": 16},
], ids=["whole", "chunked", "chunked-async", "prefix-cache"])
def test_prompt_logprobs_match_the_reference(make_engine, reference_model, config):
    engine = make_engine(**config)
    vocab = engine.model_config.vocab_size
    shared = _prompts([24], seed=101, vocab=vocab)[0]
    a, b, c = _prompts([37, 5, 50], seed=102, vocab=vocab)
    requests = {
        "a": (a, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)),
        "b": (b, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0, logprobs=1)),
        "plain": (c, SamplingParams(temperature=0, max_tokens=4)),
        "warm": (shared + c[:9], SamplingParams(temperature=0, max_tokens=1)),
    }
    _run(engine, requests)
    # a prompt whose first 24 tokens are cached still scores every position
    d = shared + a[:13]
    outputs = _run(engine, {
        "d": (d, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5)),
        "e": (a, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)),
    })
    (first_d,) = [o for o in outputs["d"] if o.prompt_logprobs is not None]
    assert first_d is outputs["d"][0] and first_d.num_cached_tokens == 0
    _check(first_d.prompt_logprobs, d, _reference(reference_model, d, 5))
    _check(outputs["e"][0].prompt_logprobs, a, _reference(reference_model, a, 3))
    if config.get("enable_prefix_caching"):  # the same prompt without them hits the cache
        plain = _run(engine, {"f": (d, SamplingParams(temperature=0, max_tokens=1))})
        assert plain["f"][0].num_cached_tokens == 32


def test_prompt_logprobs_top_zero_and_requests_that_do_not_ask(make_engine, reference_model):
    engine = make_engine(max_num_batched_tokens=16)
    vocab = engine.model_config.vocab_size
    a, b = _prompts([30, 12], seed=103, vocab=vocab)
    outputs = _run(engine, {
        "a": (a, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)),
        "b": (b, SamplingParams(temperature=0, max_tokens=2)),
        "one": ([a[0]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)),
    })
    _check(outputs["a"][0].prompt_logprobs, a, _reference(reference_model, a, 0))
    assert all(o.prompt_logprobs is None for o in outputs["b"] + outputs["a"][1:])
    assert outputs["one"][0].prompt_logprobs == ()  # token 0 has no logprob


def test_max_tokens_zero_scores_the_prompt_without_generating(make_engine, reference_model):
    engine = make_engine(max_num_batched_tokens=16, async_scheduling=True)
    vocab = engine.model_config.vocab_size
    (a,) = _prompts([41], seed=104, vocab=vocab)
    outputs = _run(engine, {
        "score": (a, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)),
        "bare": (a[:7], SamplingParams(max_tokens=0)),
    })
    (score,) = outputs["score"]
    assert score.finish_reason == "length" and score.new_token_ids == ()
    assert score.num_output_tokens == 0
    _check(score.prompt_logprobs, a, _reference(reference_model, a, 1))
    (bare,) = outputs["bare"]
    assert (bare.finish_reason, bare.new_token_ids, bare.prompt_logprobs) == ("length", (), None)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    (result,) = engine.generate([a], SamplingParams(temperature=0, max_tokens=0,
                                                    prompt_logprobs=1))
    assert result.token_ids == () and result.finish_reason == "length"
    _check(result.prompt_logprobs, a, _reference(reference_model, a, 1))


def test_prompt_logprobs_survive_preemption(make_engine, reference_model):
    # 6 blocks of 16 tokens cannot hold both long requests: one is preempted
    # mid-way and recomputed; no position is scored twice or lost
    engine = make_engine(num_blocks=6, block_size=16, max_num_batched_tokens=16)
    vocab = engine.model_config.vocab_size
    a, b = _prompts([40, 36], seed=105, vocab=vocab)
    outputs = _run(engine, {
        "a": (a, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                prompt_logprobs=2)),
        "b": (b, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                prompt_logprobs=2)),
    })
    assert engine.stats().num_preemptions > 0
    for rid, prompt in (("a", a), ("b", b)):
        (entries,) = [o.prompt_logprobs for o in outputs[rid] if o.prompt_logprobs is not None]
        _check(entries, prompt, _reference(reference_model, prompt, 2))


def test_remote_reservations_refuse_max_tokens_zero(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="max_tokens 0"):
        engine.reserve_remote("r", [1, 2, 3], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
