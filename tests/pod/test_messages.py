"""`pod.messages`: proto <-> engine conversions and boundary checks."""

from __future__ import annotations

import dataclasses

import pytest

from engine.grammar import GrammarKind, GrammarSpec
from engine.sampling_params import SamplingParams
from pod.messages import (
    CheckedRequest,
    ModelLimits,
    check_context,
    check_request,
    sampling_from_proto,
)
from proto import pdserve_pb2

LIMITS = ModelLimits(vocab_size=100, max_model_len=50)


def test_proto_defaults_mean_off():
    params = sampling_from_proto(pdserve_pb2.SamplingParams(max_tokens=3))
    assert params == SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_tokens=3,
                                    logprobs=None)


def test_every_field_is_carried():
    msg = pdserve_pb2.SamplingParams(temperature=0.7, top_p=0.5, top_k=9, seed=0, max_tokens=4,
                                     stop_token_ids=[3, 4], ignore_eos=True, logprobs=2,
                                     stop=["\n"])
    params = sampling_from_proto(msg)
    assert params.temperature == pytest.approx(0.7)  # proto floats are 32-bit
    assert dataclasses.replace(params, temperature=0.7) == SamplingParams(
        temperature=0.7, top_p=0.5, top_k=9, seed=0, max_tokens=4,
        stop_token_ids=(3, 4), stop=("\n",), ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("kind", list(GrammarKind))
def test_grammar_is_carried(kind):
    msg = pdserve_pb2.SamplingParams(max_tokens=3,
                                     grammar=pdserve_pb2.Grammar(**{kind.value: "x+"}))
    assert sampling_from_proto(msg).grammar == GrammarSpec(kind, "x+")
    assert sampling_from_proto(pdserve_pb2.SamplingParams(max_tokens=3)).grammar is None
    empty = pdserve_pb2.SamplingParams(max_tokens=3, grammar=pdserve_pb2.Grammar())
    assert sampling_from_proto(empty).grammar is None  # no oneof field set: no grammar


@pytest.mark.parametrize(("prompt", "outputs", "max_tokens", "message"), [
    ([], [], 4, "prompt_token_ids must be non-empty"),
    ([1, 100], [], 4, "prompt_token_ids contains 100, outside the vocabulary [0, 100)"),
    ([1], [-1], 4, "output_token_ids contains -1, outside the vocabulary [0, 100)"),
    ([1], [2, 3], 2, "output_token_ids already holds 2 tokens, max_tokens is 2"),
    ([1] * 47, [], 4, "prompt (47 tokens) + max_tokens (4) = 51 exceeds max_model_len 50"),
    ([1] * 50, [], 4, "context of 50 tokens exceeds max_model_len 50"),
])
def test_check_context_names_the_limit(prompt, outputs, max_tokens, message):
    with pytest.raises(ValueError) as err:
        check_context(prompt, outputs, SamplingParams(max_tokens=max_tokens), LIMITS)
    assert str(err.value) == message


def test_check_context_accepts_exactly_the_limit():
    check_context([1] * 46, [], SamplingParams(max_tokens=4), LIMITS)


def test_check_request_returns_the_checked_fields():
    request = pdserve_pb2.DecodeGenerateRequest(
        request_id="r1", prompt_token_ids=[1, 2], output_token_ids=[3],
        sampling=pdserve_pb2.SamplingParams(max_tokens=4))
    assert check_request(request, LIMITS) == CheckedRequest(
        "r1", [1, 2], [3], SamplingParams(temperature=0.0, max_tokens=4))


@pytest.mark.parametrize(("request_id", "prompt", "message"), [
    ("", [1], "request_id must be a non-empty string"),
    ("r" * 65, [1], "request_id is 65 bytes UTF-8, the limit is 64"),
    ("r1", [], "prompt_token_ids must be non-empty"),
])
def test_check_request_refuses_what_the_checks_refuse(request_id, prompt, message):
    request = pdserve_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                         sampling=pdserve_pb2.SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=message):
        check_request(request, LIMITS)


def test_logits_adjustments_cross_the_wire():
    msg = pdserve_pb2.SamplingParams(max_tokens=8, presence_penalty=0.5, frequency_penalty=-1.0,
                                     min_tokens=2, stop_token_ids=[9])
    msg.logit_bias[7] = -100.0
    params = sampling_from_proto(msg)
    assert params == SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=0.5,
                                  frequency_penalty=-1.0,
                                  repetition_penalty=1.0, logit_bias={7: -100.0}, min_tokens=2,
                                  stop_token_ids=(9,))
    assert params.needs_logits_processing
    assert not sampling_from_proto(pdserve_pb2.SamplingParams(max_tokens=8)).needs_logits_processing
    msg.logit_bias[100] = 1.0
    with pytest.raises(ValueError,
                       match=r"logit_bias holds token id 100, outside the vocabulary \[0, 100\)"):
        check_context([1, 2], [], sampling_from_proto(msg), LIMITS)


def test_a_negative_count_is_refused_not_read_as_none():
    """proto/sampling_wire.py: only 0 means none; -1 is out of range."""
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\], got -1"):
        sampling_from_proto(pdserve_pb2.SamplingParams(max_tokens=3, logprobs=-1))
