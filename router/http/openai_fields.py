"""Which request fields this server honours, accepts without effect, or
refuses: the policy that keeps a client from getting a 200 that silently
differs from what it asked for.

Called by router.http.requests (`_common_fields`, `_sampling`) on the event
loop, once per request. The endpoint's field set (`COMPLETION_FIELDS`,
`CHAT_FIELDS`) lists every top-level field it knows: OpenAI's and the
router's documented extensions. `check_known` answers any other field with
a 400 naming it (`min_p`, `use_beam_search`, a typo: the server does not
honour them, so it must not ignore them), and a field of the other
endpoint (`messages` or `tools` on /v1/completions, `prompt` on chat) with
a 400 saying where it belongs. A field set to null counts as not set, as it
does for OpenAI. The `openai` client's `extra_body={...}` keys arrive as
top-level fields and are judged like any other.

Of the known fields, one in `ACCEPTED_WITHOUT_EFFECT` cannot change the
output on this server (the reason is beside it); one in `REFUSED` is
answered with a 400 naming it unless it holds its neutral value; the rest
are honoured. Every field of the installed `openai` package's request
types, and every extension here, has an entry in
tests/integration/openai_schema_table.py, which
tests/integration/test_sampling_params.py checks against real pods.

The fields that adjust logits (penalties, `logit_bias`, `min_tokens`,
`stop_token_ids`) and `n`/`best_of` are read here too; their limits are
SamplingSpec's (proto/sampling_limits.py's `API_LIMITS`) and `MAX_N`.
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

# The router's extensions on both endpoints (vLLM's names): sampling fields
# read by router.http.requests, grammars by router.structured_output.
EXTENSIONS = frozenset({
    "top_k", "ignore_eos", "repetition_penalty", "min_tokens", "stop_token_ids",
    "guided_json", "guided_choice", "guided_regex", "guided_grammar",
    "return_tokens_as_token_ids",
})
_BOTH = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
    "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "n", "best_of", "user",
    "echo",  # completions honour it; chat only takes its neutral false (REFUSED)
    "response_format",  # OpenAI's on chat; on completions an extension, as in vLLM
}) | EXTENSIONS
# Every top-level field each endpoint knows; anything else is a 400 naming it.
COMPLETION_FIELDS = _BOTH | {"prompt", "suffix", "prompt_logprobs"}
CHAT_FIELDS = _BOTH | set(ACCEPTED_WITHOUT_EFFECT) | (set(REFUSED) - {"suffix"}) | {
    "messages", "max_completion_tokens", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "documents",  # router.tools.request
}
FIELDS = {"completion": COMPLETION_FIELDS, "chat": CHAT_FIELDS}
ENDPOINTS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
# Unknown fields whose 400 can say what the client probably meant.
_HINTS = {
    "extra_body": "the openai client's extra_body={...} sends its keys as top-level fields",
    "session_id": "the session id is 'user' or the x-session-id header",
}


def check_known(body: dict[str, Any], kind: str) -> None:
    """400 naming the first field (in the body's order) that `kind`'s
    endpoint does not know: another endpoint's, or nobody's."""
    other = "chat" if kind == "completion" else "completion"
    for name, value in body.items():
        if name in FIELDS[kind] or value is None:
            continue
        if name in FIELDS[other]:
            raise bad_request(f"'{name}' is a {ENDPOINTS[other]} field; "
                              f"{ENDPOINTS[kind]} does not take it", name)
        hint = f"; {_HINTS[name]}" if name in _HINTS else ""
        raise bad_request(f"Unrecognized request argument supplied: '{name}' ({ENDPOINTS[kind]} "
                          f"refuses the fields it does not honour rather than ignore them"
                          f"{hint})", name)


def check_refused(body: dict[str, Any], kind: str) -> None:
    """400 naming the first known field this server cannot honour."""
    for name, neutral in REFUSED.items():
        if name == "echo" and kind == "completion":
            continue
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v)
                                         for v in neutral):
            allowed = " or ".join(repr(v) for v in neutral) or "null"
            raise bad_request(f"'{name}' is not supported by this server (only {allowed})", name)


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
