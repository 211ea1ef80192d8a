"""n > 1: the per-choice requests and the summed usage (router.http.choices).
The end-to-end proof is tests/integration/test_sampling_params.py."""

from __future__ import annotations

from router.generation import GenerationRequest, Usage
from router.http.choices import choice_requests, choice_seed, summed_usage
from router.sampling import SamplingSpec


def test_choice_requests_share_the_prompt_and_keep_their_own_seeds():
    base = GenerationRequest("abc", (5, 6, 7), SamplingSpec(max_tokens=4, seed=11), "s")
    choices = choice_requests(base, 3)
    assert [c.request_id for c in choices] == ["abc-0", "abc-1", "abc-2"]
    assert all(c.prompt_token_ids == (5, 6, 7) and c.session_id == "s" for c in choices)
    seeds = [c.sampling.seed for c in choices]
    assert seeds[0] == 11 and len(set(seeds)) == 3
    assert seeds == [choice_seed(11, i) for i in range(3)]
    unseeded = choice_requests(GenerationRequest("x", (1,), SamplingSpec(max_tokens=1)), 2)
    assert [c.sampling.seed for c in unseeded] == [None, None]


def test_usage_counts_the_prompt_once():
    usage = summed_usage([Usage(10, 4, 8), Usage(10, 6, 10), Usage(10, 1, 10)])
    assert usage == Usage(prompt_tokens=10, completion_tokens=11, cached_tokens=8)
