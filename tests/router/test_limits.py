"""`router.limits.InputLimits`: limits derived from the context limit."""

from __future__ import annotations

import json

import pytest

from router.api_error import ApiError
from router.generation import ChatMessage, ParsedRequest
from router.limits import InputLimits


def test_limits_derive_from_the_context():
    limits = InputLimits.for_context(4096)
    assert limits.max_prompt_chars == 4096 * 32
    assert limits.max_body_bytes == 4096 * 32 * 12 + 64 * 1024
    assert limits.max_json_depth == 64
    # every prompt the character limit accepts fits the body limit, escaped
    assert limits.max_body_bytes > limits.max_prompt_chars * len(json.dumps("\U0001f600")[1:-1])


def test_prompt_characters_are_checked_before_tokenizing():
    limits = InputLimits.for_context(64)
    limits.check_prompt_chars(ParsedRequest(kind="completion", model="m", prompt="x" * 2048), 64)
    with pytest.raises(ApiError) as err:
        limits.check_prompt_chars(
            ParsedRequest(kind="completion", model="m", prompt="x" * 2049), 64)
    assert (err.value.status, err.value.param) == (400, "prompt")
    assert err.value.message == ("'prompt' has 2049 characters, over the limit of 2048 "
                                 "(max_model_len 64 x 32 characters per token): it cannot "
                                 "fit the context")
    chat = ParsedRequest(kind="chat", model="m", messages=(
        ChatMessage("system", "s" * 2000), ChatMessage("user", "u" * 49)))
    with pytest.raises(ApiError) as err:
        limits.check_prompt_chars(chat, 64)
    assert err.value.param == "messages"
    # token ids are counted by fit_context, not here
    limits.check_prompt_chars(ParsedRequest(kind="completion", model="m",
                                            prompt_token_ids=(1,) * 5000), 64)


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_prompt_chars": 0, "max_body_bytes": 1}, "max_prompt_chars must be >= 1, got 0"),
    ({"max_prompt_chars": 1, "max_body_bytes": 0}, "max_body_bytes must be >= 1, got 0"),
    ({"max_prompt_chars": 1, "max_body_bytes": 1, "max_json_depth": 0},
     "max_json_depth must be >= 1, got 0"),
])
def test_bad_limits_are_refused(fields, message):
    with pytest.raises(ValueError) as err:
        InputLimits(**fields)
    assert str(err.value) == message
