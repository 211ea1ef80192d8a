import math

import pytest
import torch

from engine.sampler import Sampler, _filter_top_k_top_p, seed_for_index
from engine.sampling_params import SamplingParams


def _logits(rows=3, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_is_argmax():
    logits = _logits()
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 3, [0, 5, 9])
    assert out.token_ids == tuple(logits.argmax(-1).tolist())
    assert out.logprobs == (None, None, None)


def test_seeded_rows_independent_of_batch_and_engine_seed():
    logits = _logits(rows=4)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler(seed=0)(logits[2:3], [p], [7]).token_ids[0] for _ in range(3)]
    others = [SamplingParams(), SamplingParams(temperature=0), p, SamplingParams(seed=5)]
    batched = Sampler(seed=99)(logits, others, [0, 3, 7, 1]).token_ids[2]
    assert alone == [batched] * 3
    # The draw depends on the output index.
    draws = {Sampler()(logits[2:3], [p], [i]).token_ids[0] for i in range(40)}
    assert len(draws) > 1
    assert seed_for_index(1234, 7) != seed_for_index(1234, 8)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.clamp_min(1e-30).log()[None, :].repeat(4000, 1)
    params = [SamplingParams(seed=s) for s in range(4000)]
    tokens = torch.tensor(Sampler()(logits, params, [0] * 4000).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    assert freq[3] == 0


def test_top_k_and_top_p_filters():
    scaled = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]]))
    out = _filter_top_k_top_p(scaled, [2, 0], [1.0, 0.7])
    inf = float("-inf")
    assert out[0].tolist()[0] == inf and out[0].tolist()[2] == inf
    assert out[0, 1] == scaled[0, 1] and out[0, 3] == scaled[0, 3]
    # top_p 0.7: 0.4 (mass before 0) and 0.3 (mass before 0.4) kept; 0.2 has 0.7 before it.
    assert [v == inf for v in out[1].tolist()] == [True, False, True, False]
    logits = _logits(rows=2)
    sampler = Sampler()
    for params in ([SamplingParams(top_k=1)] * 2, [SamplingParams(top_p=1e-6, seed=1)] * 2):
        assert sampler(logits, params, [0, 0]).token_ids == tuple(logits.argmax(-1).tolist())


def test_logprobs_are_of_raw_distribution():
    logits = _logits(rows=2, vocab=10)
    params = [SamplingParams(temperature=0.5, logprobs=3, seed=3), SamplingParams(temperature=0)]
    out = Sampler()(logits, params, [0, 0])
    ref = logits[0].log_softmax(-1)
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0]
    assert math.isclose(lp.logprob, ref[lp.token_id].item(), rel_tol=1e-6)
    top = ref.topk(3)
    assert lp.top_token_ids == tuple(top.indices.tolist())
    assert lp.top_logprobs == pytest.approx(top.values.tolist(), rel=1e-6)
    assert out.logprobs[1] is None
    zero = Sampler()(logits[:1], [SamplingParams(temperature=0, logprobs=0)], [0]).logprobs[0]
    assert zero.top_token_ids == () and zero.top_logprobs == ()


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="must be"):
        Sampler()(_logits(rows=2), [SamplingParams()], [0])
