"""proto.sampling_limits: every sampling limit accepted at the limit and
refused just past it, with a message naming the field and the limit; the
engine's and the API's tables where they differ."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from proto.sampling_limits import (
    API_LIMITS,
    ENGINE_LIMITS,
    MAX_INT32,
    MAX_SEED,
    SamplingLimits,
    check_in_vocabulary,
    check_sampling,
)


class Refused(Exception):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class Fields:
    """A SamplingFields with neutral values (the engine's and the router's
    types are tested in their own packages)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: object = ()
    min_tokens: int = 0


def _check(limits: SamplingLimits, *, may_score_only: bool = True, **fields) -> None:
    check_sampling(Fields(**fields), limits, Refused, may_score_only=may_score_only)


def _refused(limits: SamplingLimits, **fields) -> Refused:
    with pytest.raises(Refused) as info:
        _check(limits, **fields)
    return info.value


# (limits, field, value at the limit, value past it, the message past it)
CASES = [
    (API_LIMITS, "temperature", 2.0, 3.0, "must be in [0, 2], got 3.0"),
    (API_LIMITS, "temperature", 0.0, -1.0, "must be in [0, 2], got -1.0"),
    (ENGINE_LIMITS, "temperature", 0.0, -1.0, "must be a finite number >= 0, got -1.0"),
    (API_LIMITS, "top_p", 1.0, 2.0, "must be in (0, 1], got 2.0"),
    (ENGINE_LIMITS, "top_p", 1e-9, 0.0, "must be in (0, 1], got 0.0"),
    (API_LIMITS, "top_k", MAX_INT32, MAX_INT32 + 1,
     f"must be in [-1, {MAX_INT32}], got {MAX_INT32 + 1}"),
    (API_LIMITS, "top_k", -1, -2, f"must be in [-1, {MAX_INT32}], got -2"),
    (ENGINE_LIMITS, "top_k", 0, -1, "must be >= 0, got -1"),
    (ENGINE_LIMITS, "seed", MAX_SEED, MAX_SEED + 1,
     f"must be in [0, {MAX_SEED}], got {MAX_SEED + 1}"),
    (ENGINE_LIMITS, "seed", 0, -1, f"must be in [0, {MAX_SEED}], got -1"),
    (API_LIMITS, "logprobs", 20, 21, "must be in [0, 20], got 21"),
    (ENGINE_LIMITS, "prompt_logprobs", 20, 21, "must be in [0, 20], got 21"),
    (API_LIMITS, "presence_penalty", 2.0, 3.0, "must be in [-2, 2], got 3.0"),
    (ENGINE_LIMITS, "frequency_penalty", -2.0, -3.0, "must be in [-2, 2], got -3.0"),
    (API_LIMITS, "repetition_penalty", 1e6, 1e6 + 1,
     "must be in (0, 1000000] (1 = off), got 1000001.0"),
    (ENGINE_LIMITS, "repetition_penalty", 1e-9, 0.0,
     "must be a finite number > 0 (1 = off), got 0.0"),
    (API_LIMITS, "stop", ("x",) * 16, ("x",) * 17, "may hold at most 16 strings, got 17"),
    (API_LIMITS, "stop_token_ids", (1,) * 64, (1,) * 65, "may hold at most 64 ids, got 65"),
    (API_LIMITS, "stop_token_ids", (MAX_INT32,), (MAX_INT32 + 1,),
     f"must be token ids in [0, {MAX_INT32}], got [{MAX_INT32 + 1}]"),
    (ENGINE_LIMITS, "stop_token_ids", (0,), (-1,), "must be token ids >= 0, got [-1]"),
    (API_LIMITS, "logit_bias", tuple((i, 1.0) for i in range(300)),
     tuple((i, 1.0) for i in range(301)), "may hold at most 300 entries, got 301"),
    (ENGINE_LIMITS, "logit_bias", {5: 100.0}, {5: 101.0},
     "values must be in [-100, 100], got 101.0 for token 5"),
    (API_LIMITS, "logit_bias", ((5, -100.0),), ((5, -101.0),),
     "values must be in [-100, 100], got -101.0 for token 5"),
    (API_LIMITS, "logit_bias", ((MAX_INT32, 1.0),), ((MAX_INT32 + 1, 1.0),),
     f"keys must be token ids in [0, {MAX_INT32}], got {MAX_INT32 + 1}"),
    (ENGINE_LIMITS, "logit_bias", {0: 1.0}, {-1: 1.0}, "keys must be token ids >= 0, got -1"),
    (ENGINE_LIMITS, "min_tokens", 16, 17, "must be at most max_tokens (16), got 17"),
    (API_LIMITS, "min_tokens", 0, -1, "must be >= 0, got -1"),
]


@pytest.mark.parametrize(("limits", "field", "at_limit", "past_limit", "message"), CASES)
def test_accepted_at_the_limit_refused_past_it(limits, field, at_limit, past_limit, message):
    _check(limits, **{field: at_limit})
    refused = _refused(limits, **{field: past_limit})
    assert (refused.field, refused.problem) == (field, message)


def test_the_engine_runs_what_the_api_refuses():
    """The API's table is the tighter one: each of its own limits is a value
    the engine takes."""
    past_api = dict(temperature=3.0, top_k=MAX_INT32 + 1, repetition_penalty=2e6,
                    stop=("x",) * 17, stop_token_ids=(MAX_INT32 + 1,) + (1,) * 64,
                    logit_bias={MAX_INT32 + 1: 1.0})
    for field, value in past_api.items():
        _check(ENGINE_LIMITS, **{field: value})
        assert _refused(API_LIMITS, **{field: value}).field == field


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_floats_must_be_finite(field, value):
    for limits in (ENGINE_LIMITS, API_LIMITS):
        assert _refused(limits, **{field: value}).field == field
    assert _refused(API_LIMITS, logit_bias=((1, value),)).field == "logit_bias"


def test_max_tokens_zero_only_scores_the_prompt():
    _check(API_LIMITS, max_tokens=None, may_score_only=False)  # not given yet
    _check(API_LIMITS, max_tokens=0, may_score_only=True)
    refused = _refused(API_LIMITS, max_tokens=0, may_score_only=False)
    assert (refused.field, refused.problem) == ("max_tokens", (
        "must be at least 1, got 0 (0 only scores the prompt: with 'echo': true or "
        "'prompt_logprobs')"))
    refused = _refused(ENGINE_LIMITS, max_tokens=-1)
    assert refused.problem == "must be >= 0 (0 = score the prompt only), got -1"


def test_stop_strings_must_not_be_empty():
    for limits in (ENGINE_LIMITS, API_LIMITS):
        refused = _refused(limits, stop=("x", ""))
        assert (refused.field, refused.problem) == ("stop", "strings must not be empty")


def test_vocabulary():
    check_in_vocabulary("logit_bias", [0, 99], 100, Refused)
    with pytest.raises(Refused) as info:
        check_in_vocabulary("stop_token_ids", [5, 100], 100, Refused)
    assert (info.value.field, info.value.problem) == (
        "stop_token_ids", "holds token id 100, outside the vocabulary [0, 100)")

