"""SamplingSpec: the one check of the sampling limits, the context limit, and
the SamplingParams conversion pair."""

from __future__ import annotations

import pytest

from proto import pdserve_pb2 as pb
from router.api_error import ApiError
from router.sampling import (
    SamplingError,
    SamplingSpec,
    check_vocabulary,
    fit_context,
    sampling_from_proto,
    sampling_to_proto,
)


def _fit(spec: SamplingSpec, num_prompt_tokens: int, *, chat: bool = False) -> SamplingSpec:
    return fit_context(spec, chat=chat, num_prompt_tokens=num_prompt_tokens, max_model_len=128)


def test_fit_context_defaults_and_limit():
    completion = SamplingSpec()
    assert _fit(completion, 10).max_tokens == 16
    assert _fit(completion, 120).max_tokens == 8
    spec = _fit(SamplingSpec(temperature=0.0), 28, chat=True)
    assert spec == SamplingSpec(max_tokens=100, temperature=0.0)
    with pytest.raises(ApiError) as info:
        _fit(SamplingSpec(max_tokens=100), 30)
    assert info.value.param == "max_tokens"
    assert info.value.message == (
        "this model's maximum context length is 128 tokens; the prompt is 30 tokens and "
        "max_tokens is 100 (130 in total): lower max_tokens to at most 98"
    )
    with pytest.raises(ApiError, match="leaves no room in the model's context of 128 tokens"):
        _fit(completion, 128)


def test_sampling_spec_validates():
    with pytest.raises(ValueError, match="'top_p' must be in"):
        SamplingSpec(max_tokens=1, top_p=0)
    with pytest.raises(ValueError, match="'max_tokens' must be at least 1"):
        SamplingSpec(max_tokens=0)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"temperature": 2.5}, "temperature", "'temperature' must be in [0, 2], got 2.5"),
        ({"top_k": -2}, "top_k", "'top_k' must be in [-1, 2147483647], got -2"),
        ({"seed": -1}, "seed", "'seed' must be in [0, 18446744073709551615], got -1"),
        ({"logprobs": 21}, "logprobs", "'logprobs' must be in [0, 20], got 21"),
        ({"stop": ("",)}, "stop", "'stop' strings must not be empty"),
        ({"stop": ("x",) * 17}, "stop", "'stop' may hold at most 16 strings, got 17"),
    ],
)
def test_sampling_error_names_the_field(fields, field, message):
    with pytest.raises(SamplingError) as info:
        SamplingSpec(**fields)
    assert (info.value.field, str(info.value)) == (field, message)
    error = info.value.to_api_error("other_name")
    assert (error.status, error.param) == (400, "other_name")
    assert error.message == message.replace(f"'{field}'", "'other_name'")


def test_top_k_minus_one_is_off():
    assert SamplingSpec(top_k=-1).top_k == 0


def test_proto_pair():
    spec = SamplingSpec(max_tokens=7, temperature=0.5, top_p=0.5, top_k=3, seed=9,
                        stop=("\n", "END"), ignore_eos=True, logprobs=2)
    assert sampling_from_proto(sampling_to_proto(spec)) == spec
    # proto zeros mean unset; temperature 0 is greedy
    assert sampling_from_proto(pb.SamplingParams()) == SamplingSpec(temperature=0.0)
    # n = 0 ("only the sampled token's logprob") asks the pods for one alternative
    assert sampling_to_proto(SamplingSpec(max_tokens=1, logprobs=0)).logprobs == 1
    assert sampling_to_proto(SamplingSpec(max_tokens=1)).logprobs == 0
    assert not sampling_to_proto(SamplingSpec(max_tokens=1)).HasField("seed")


def test_fit_context_caps_the_default_by_the_largest_pod():
    def fit(spec, prompt, *, chat=True, capacity=64):
        return fit_context(spec, chat=chat, num_prompt_tokens=prompt, max_model_len=128,
                           pod_capacity=capacity)

    assert fit(SamplingSpec(), 28).max_tokens == 36  # the pod's 64 tokens, not the context's 100
    assert fit(SamplingSpec(), 28, capacity=0).max_tokens == 100  # no report yet: the context
    assert fit(SamplingSpec(), 60, chat=False).max_tokens == 4
    with pytest.raises(ApiError) as info:
        fit(SamplingSpec(max_tokens=40), 28)
    assert info.value.param == "max_tokens"
    assert info.value.message == (
        "the largest decode pod holds KV for 64 tokens; the prompt is 28 tokens and max_tokens "
        "is 40: lower max_tokens to at most 36")
    with pytest.raises(ApiError, match="holds KV for 64 tokens, which leaves no room") as info:
        fit(SamplingSpec(), 64)
    assert info.value.param == "messages"
    with pytest.raises(ApiError, match="'min_tokens' must be at most max_tokens") as info:
        fit(SamplingSpec(min_tokens=20), 28, chat=False)  # the default 16
    assert info.value.param == "min_tokens"


def test_logits_fields_limits_and_wire_form():
    spec = SamplingSpec(max_tokens=8, presence_penalty=-2.0, frequency_penalty=1.5,
                        repetition_penalty=1.25, logit_bias=((3, -100.0), (7, 2.5)),
                        min_tokens=8, stop_token_ids=(5, 9))
    message = sampling_to_proto(spec)
    assert dict(message.logit_bias) == {3: -100.0, 7: 2.5}
    assert list(message.stop_token_ids) == [5, 9] and message.min_tokens == 8
    assert sampling_from_proto(message) == spec
    for fields, name in (({"presence_penalty": 2.01}, "presence_penalty"),
                         ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                         ({"repetition_penalty": -1.0}, "repetition_penalty"),
                         ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
                         ({"min_tokens": -1}, "min_tokens"),
                         ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
                         ({"stop_token_ids": (-4,)}, "stop_token_ids")):
        with pytest.raises(SamplingError) as info:
            SamplingSpec(**fields)
        assert info.value.field == name


def test_check_vocabulary_names_the_field_and_the_vocabulary():
    check_vocabulary(SamplingSpec(logit_bias=((99, 1.0),), stop_token_ids=(99,)), 100)
    with pytest.raises(SamplingError) as info:
        check_vocabulary(SamplingSpec(logit_bias=((3, 1.0), (100, 1.0))), 100)
    assert (info.value.field, str(info.value)) == (
        "logit_bias", "'logit_bias' holds token id 100, outside the vocabulary [0, 100)")
    with pytest.raises(SamplingError) as info:
        check_vocabulary(SamplingSpec(stop_token_ids=(100,)), 100)
    assert info.value.field == "stop_token_ids"
