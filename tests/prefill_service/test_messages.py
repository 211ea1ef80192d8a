"""`prefill_service.messages`: proto <-> engine conversions and boundary checks."""

from __future__ import annotations

import dataclasses

import pytest

from engine.outputs import RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams
from prefill_service.messages import (
    ModelLimits,
    check_context,
    check_request_id,
    sampling_from_proto,
    tokens_message,
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


def test_request_id_limits():
    check_request_id("r" * 64)
    with pytest.raises(ValueError, match="request_id is 65 bytes UTF-8, the limit is 64"):
        check_request_id("r" * 65)
    with pytest.raises(ValueError, match="request_id must be non-empty"):
        check_request_id("")


def test_tokens_message_carries_index_logprobs_and_reason():
    output = RequestOutput("r", (7, 8), (TokenLogprobs(7, -0.5, (7, 2), (-0.5, -1.5)),
                                         TokenLogprobs(8, -0.25, (8,), (-0.25,))),
                           "length", num_prompt_tokens=12, num_cached_tokens=4,
                           num_output_tokens=5)
    tokens = tokens_message(output, first_index=3).tokens
    assert (tokens.first_index, list(tokens.token_ids), tokens.finish_reason) == (3, [7, 8],
                                                                                  "length")
    assert (tokens.num_prompt_tokens, tokens.num_cached_tokens) == (12, 4)
    assert [(lp.token_id, lp.logprob, list(lp.top_token_ids)) for lp in tokens.logprobs] == [
        (7, -0.5, [7, 2]), (8, -0.25, [8])]
