"""What a decode pod refuses of a split prefill (`DecodeGenerateRequest.split_at`),
each with a message that names the limit (INVALID_ARGUMENT at the servicer)."""

from __future__ import annotations

import pytest

from decode_service.servicer import _check_split
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _request(**fields) -> pb.DecodeGenerateRequest:
    return pb.DecodeGenerateRequest(**{"request_id": "r", "prompt_token_ids": list(range(10, 110)),
                                       "remote_prefill": True, **fields})


def test_a_split_inside_the_context_passes_and_none_is_no_split():
    _check_split(_request(split_at=55), 100, GREEDY)
    _check_split(_request(), 100, GREEDY)
    _check_split(pb.DecodeGenerateRequest(request_id="r"), 100, GREEDY)


@pytest.mark.parametrize(("fields", "params", "message"), [
    ({"split_at": 100}, GREEDY, r"split_at 100 must be in \[1, 100\)"),
    ({"split_at": -3}, GREEDY, r"split_at -3 must be in \[1, 100\)"),
    ({"split_at": 50, "remote_prefill": False}, GREEDY, "needs remote_prefill=true"),
    ({"split_at": 50, "local_prefill_below": 8}, GREEDY, "and no local_prefill_below"),
    ({"split_at": 50}, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1),
     "split_at with prompt_logprobs"),
], ids=["past-the-context", "negative", "not-remote", "local-below", "prompt-logprobs"])
def test_what_a_split_cannot_do_is_refused_by_name(fields, params, message):
    with pytest.raises(ValueError, match=message):
        _check_split(_request(**fields), 100, params)
