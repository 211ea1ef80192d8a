"""Which OpenAI request fields this server honours, accepts without effect,
or refuses: the policy that keeps a client from getting a 200 that silently
differs from what it asked for.

Called by router.http.requests (`_common_fields`, `_sampling`) on the event
loop, once per request. A field listed in `ACCEPTED_WITHOUT_EFFECT` cannot
change the output on this server (the reason is beside it); a field in
`REFUSED` is answered with a 400 naming it unless it holds its neutral
value. Every field of the installed `openai` package's request types is in
one of the tables or read by router.http.requests, which
tests/router/http/test_openai_schema.py checks.

The fields that adjust logits (penalties, `logit_bias`, `min_tokens`,
`stop_token_ids`) and `n`/`best_of` are read here too; their limits are
router.logits_params' (SamplingSpec's) and `MAX_N`.
"""

from __future__ import annotations

import math
from typing import Any

from router.api_error import bad_request

MAX_N = 16  # choices per request: n requests fan out to the pods

# Cannot change what this server generates; accepted (type-checked loosely).
ACCEPTED_WITHOUT_EFFECT = {
    "metadata": "tags for stored completions; this server stores nothing",
    "store": "this server stores no completions",
    "service_tier": "one tier: every request is served alike",
    "safety_identifier": "an abuse-tracking tag for OpenAI; nothing here reads it",
    "prompt_cache_key": "prefix caching and cache-aware routing are automatic",
    "prompt_cache_options": "prefix caching is automatic",
    "prompt_cache_retention": "the prefix cache keeps blocks until evicted (LRU)",
    "prediction": "predicted outputs only speed up generation; the output is the same",
}

# field -> the values that mean "not used" (None always does); anything else -> 400.
REFUSED: dict[str, tuple[Any, ...]] = {
    "suffix": (),
    "audio": (),
    "modalities": (["text"],),
    "moderation": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "echo": (False,),  # chat only: completions honour it (router.http.echo)
    # the deprecated forms of tools / tool_choice: send those instead
    "functions": ([],),
    "function_call": ("none",),
}

# Fields of one endpoint only: sent to the other, they are refused by name.
CHAT_ONLY = ("max_completion_tokens", "top_logprobs")


def check_refused(body: dict[str, Any], kind: str) -> None:
    """400 naming the first field this server cannot honour."""
    for name, neutral in REFUSED.items():
        if name == "echo" and kind == "completion":
            continue
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v)
                                         for v in neutral):
            allowed = " or ".join(repr(v) for v in neutral) or "null"
            raise bad_request(f"'{name}' is not supported by this server (only {allowed})", name)
    if kind == "completion":
        for name in CHAT_ONLY:
            if body.get(name) is not None:
                raise bad_request(f"'{name}' is a /v1/chat/completions field; "
                                  f"/v1/completions does not take it", name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not ((_is_int(value) or isinstance(value, float)) and math.isfinite(value)):
        raise bad_request(f"'{name}' must be a number, got {type(value).__name__}", name)
    return float(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI sends {"<token id>": bias} (JSON keys are strings)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers",
                          "logit_bias")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}",
                              "logit_bias") from None
        if not ((_is_int(bias) or isinstance(bias, float)) and math.isfinite(bias)):
            raise bad_request(f"'logit_bias' values must be numbers, got {bias!r}", "logit_bias")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise bad_request(f"'{name}' must be a list of token ids (integers)", name)
    return tuple(value)


def logits_fields(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingSpec keyword arguments for the logits adjustments (types
    checked here, ranges by SamplingSpec)."""
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and not _is_int(min_tokens):
        raise bad_request(f"'min_tokens' must be an integer, got {type(min_tokens).__name__}",
                          "min_tokens")
    return dict(
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_tokens=min_tokens or 0,
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
    )


def choice_count(body: dict[str, Any]) -> int:
    """`n` (1..MAX_N); `best_of` is honoured only as n (each choice is one
    sample, no ranking), else a 400 naming it."""
    n = body.get("n")
    if n is None:
        n = 1
    elif not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be an integer in [1, {MAX_N}], got {n!r}", "n")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != n):
        raise bad_request(
            f"'best_of' must equal n ({n}): ranking several samples per choice is not "
            f"supported, got {best_of!r}", "best_of")
    return n
