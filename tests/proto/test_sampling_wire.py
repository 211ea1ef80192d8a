"""proto.sampling_wire: the proto zeros of SamplingParams, read once for the
pods and the router."""

from __future__ import annotations

from proto import pdserve_pb2 as pb
from proto.sampling_wire import sampling_fields_from_proto


def test_zeros_read_as_unset():
    assert sampling_fields_from_proto(pb.SamplingParams()) == dict(
        temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=(), stop_token_ids=(),
        ignore_eos=False, logprobs=None, prompt_logprobs=None, presence_penalty=0.0,
        frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=(), min_tokens=0)


def test_set_values_are_carried():
    message = pb.SamplingParams(temperature=0.5, top_p=0.25, top_k=7, seed=0, stop=["\n"],
                                stop_token_ids=[3, 4], ignore_eos=True, logprobs=2,
                                prompt_logprobs=1, presence_penalty=1.5, frequency_penalty=-1.0,
                                repetition_penalty=1.25, min_tokens=2, max_tokens=9)
    message.logit_bias[9] = -1.0
    message.logit_bias[2] = 5.0
    fields = sampling_fields_from_proto(message)
    assert fields == dict(
        temperature=0.5, top_p=0.25, top_k=7, seed=0, stop=("\n",), stop_token_ids=(3, 4),
        ignore_eos=True, logprobs=2, prompt_logprobs=1, presence_penalty=1.5,
        frequency_penalty=-1.0, repetition_penalty=1.25, logit_bias=((2, 5.0), (9, -1.0)),
        min_tokens=2)
    assert "max_tokens" not in fields and "grammar" not in fields  # each reader's own


def test_a_negative_count_is_left_for_the_check():
    fields = sampling_fields_from_proto(pb.SamplingParams(logprobs=-1, prompt_logprobs=-2))
    assert (fields["logprobs"], fields["prompt_logprobs"]) == (-1, -2)
