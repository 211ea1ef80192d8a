"""Penalties, logit bias and min_tokens: the batched adjustment against a
per-token Python reference, and in the engine (sync and async scheduling)
against a greedy reference that applies the same rules token by token."""

from __future__ import annotations

import pytest
import torch

from engine.logits_processors import build_adjustments
from engine.reference import reference_logits
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

EOS = (1, 4)


def _reference_adjust(logits: list[float], prompt: list[int], outputs: list[int],
                      p: SamplingParams, index: int, eos=EOS) -> list[float]:
    """The rules of engine/logits_processors.py written one token at a time."""
    out = list(logits)
    seen = set(prompt) | set(outputs) if p.repetition_penalty != 1.0 else set(outputs)
    for t in seen:
        if p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(outputs):
        out[t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    for t, b in p.logit_bias.items():
        out[t] += b
    if index < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            out[t] = float("-inf")
    return out


def _request(rid, prompt, outputs, params):
    return Request(rid, prompt, params, output_token_ids=outputs)


def test_adjustments_match_the_per_token_reference():
    g = torch.Generator().manual_seed(3)
    vocab = 40
    logits = torch.randn(4, vocab, generator=g) * 3
    rows = [
        ([5, 6, 7], [8, 8, 9], SamplingParams(presence_penalty=0.5, frequency_penalty=1.5,
                                              max_tokens=8)),
        ([5, 6, 7], [8, 6], SamplingParams(repetition_penalty=1.7, max_tokens=8)),
        ([2, 3], [], SamplingParams()),  # a plain row in the same batch stays untouched
        ([2, 3], [9], SamplingParams(logit_bias={3: -100, 11: 7.5}, min_tokens=3,
                                     stop_token_ids=(12,), presence_penalty=-2.0,
                                     max_tokens=8)),
    ]
    requests = [_request(f"r{i}", p, o, sp) for i, (p, o, sp) in enumerate(rows)]
    indices = [len(o) for _, o, _ in rows]
    adj = build_adjustments(requests, indices, [None] * 4, EOS, vocab, torch.device("cpu"))
    got = adj.apply(logits)
    for i, (prompt, outputs, sp) in enumerate(rows):
        expected = _reference_adjust(logits[i].tolist(), prompt, outputs, sp, indices[i])
        assert torch.allclose(got[i], torch.tensor(expected), atol=1e-5), i
    assert torch.equal(got[2], logits[2])


def test_pending_token_comes_from_the_previous_steps_tensor():
    """With async scheduling the last output token is on the device only."""
    vocab = 16
    logits = torch.zeros(1, vocab)
    request = _request("r", [2], [5], SamplingParams(frequency_penalty=1.0, max_tokens=8))
    adj = build_adjustments([request], [2], [1], EOS, vocab, torch.device("cpu"))
    previous = torch.tensor([3, 7, 9])
    got = adj.apply(logits, previous)
    assert got[0, 5] == -1.0 and got[0, 7] == -1.0 and got[0].sum() == -2.0


def test_no_adjustment_when_every_row_is_neutral():
    request = _request("r", [2], [], SamplingParams(temperature=0, max_tokens=4))
    assert not request.sampling_params.needs_logits_processing
    assert build_adjustments([request], [0], [None], EOS, 16, torch.device("cpu")) is None


def test_greedy_rows_are_adjusted_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0, logit_bias={1: -100}, logprobs=1, max_tokens=4)
    adj = build_adjustments([_request("r", [0], [], params)], [0], [None], (), 4,
                            torch.device("cpu"))
    out = Sampler().sample(logits, [params], [0], adjustments=adj).output([params])
    assert out.token_ids == (3,)
    assert out.logprobs[0].top_token_ids == (1,)  # the raw distribution's best


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in"),
    (dict(repetition_penalty=0), "repetition_penalty must be"),
    (dict(logit_bias={5: 101}), "logit_bias values must be in"),
    (dict(logit_bias={i: 1 for i in range(301)}), "at most 300 entries"),
    (dict(min_tokens=17), "min_tokens must be at most max_tokens"),
])
def test_params_out_of_range_are_refused(bad, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        SamplingParams(**bad)


def _reference_penalized_greedy(model, prompt, params, max_tokens, eos):
    sequence, outputs = list(prompt), []
    for i in range(max_tokens):
        logits = reference_logits(model, sequence)[-1].tolist()
        adjusted = _reference_adjust(logits, prompt, outputs, params, i, eos)
        token = max(range(len(adjusted)), key=lambda t: (adjusted[t], -t))
        outputs.append(token)
        sequence.append(token)
    return outputs


def _run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_penalized_greedy_matches_reference(make_engine, reference_model,
                                                    async_scheduling):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 1100, (n,), generator=g).tolist() for n in (12, 20)]
    penalized = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                               frequency_penalty=2.0, presence_penalty=1.0,
                               repetition_penalty=1.3, logit_bias={prompts[0][0]: 5.0})
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = make_engine(async_scheduling=async_scheduling)
    got = _run(engine, [("p", prompts[0], penalized), ("q", prompts[1], plain)])
    eos = tuple(engine.eos_token_ids)
    assert got["p"] == _reference_penalized_greedy(reference_model, prompts[0], penalized, 10, eos)
    assert got["q"] == _reference_penalized_greedy(reference_model, prompts[1], plain, 10, eos)
    assert got["p"] != got["q"] or prompts[0] != prompts[1]


def test_engine_logit_bias_changes_the_greedy_token_and_min_tokens_holds_eos(make_engine):
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(10, 1100, (16,), generator=g).tolist()
    engine = make_engine()
    first = _run(engine, [("a", prompt, SamplingParams(temperature=0, max_tokens=1))])["a"][0]
    biased = SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100})
    assert _run(engine, [("b", prompt, biased)])["b"][0] != first
    # EOS forced by a +100 bias ends the request at once, unless min_tokens holds it off.
    eos = min(engine.eos_token_ids)
    forced = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100})
    assert _run(engine, [("c", prompt, forced)])["c"] == [eos]
    held = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100}, min_tokens=5)
    tokens = _run(engine, [("d", prompt, held)])["d"]
    assert len(tokens) == 6 and eos not in tokens[:5] and tokens[5] == eos
    with pytest.raises(ValueError, match="logit_bias token id 99999 is outside"):
        engine.add_request("e", prompt, SamplingParams(logit_bias={99999: 1.0}))
