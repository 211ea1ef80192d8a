"""SamplingSpec: the one check of the sampling limits, the context limit, and
the SamplingParams conversion pair."""

from __future__ import annotations

import pytest

from proto import pdserve_pb2 as pb
from router.api_error import ApiError
from router.sampling import (
    SamplingError,
    SamplingSpec,
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
