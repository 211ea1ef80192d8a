"""The per-field tables of tests/integration/test_sampling_params.py's
`test_every_openai_field_is_honoured_or_refused`, one per endpoint: for
every field of the installed `openai` package's request types, of either
endpoint (so a field OpenAI adds shows up as a missing entry, and a field
sent to the wrong endpoint is checked too), and for every field the router
knows (router.http.openai_fields: its extensions), a check that the router
either honours it (an exact effect), accepts it because it cannot matter on
this server (the reason beside it; the output must be what it is without
the field), or refuses it with a 400 naming it. `UNKNOWN_FIELDS` (vLLM's
fields this server does not honour, a typo) must be refused on both.

The tool fields are checked here against the built-in tiny model, whose
chat template does not read `tools`, so they are refused by name;
tests/router/tools/test_tool_calls_openai.py checks them honoured behind
templates that do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import openai
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from tests.integration.openai_field_values import (
    CHAT_VALUES,
    MESSAGES,
    PROMPT_IDS,
    UNKNOWN_FIELDS,
    tokens_as_ids,
)

Check = Callable[[openai.OpenAI, str], None]


def schema_fields(kind: str) -> set[str]:
    """The request fields of the installed openai package (`stream` lives on
    the streaming/non-streaming subclasses)."""
    module = completion_params if kind == "completion" else chat_params
    return set(module.CompletionCreateParamsBase.__annotations__) | set(
        module.CompletionCreateParamsNonStreaming.__annotations__)


def _create(client: openai.OpenAI, kind: str, **fields: Any) -> Any:
    """A greedy 6-token request; a field outside the endpoint's openai
    signature goes in extra_body (the client sends it as a top-level field)."""
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    for name in set(fields) - schema_fields(kind):
        extra[name] = fields.pop(name)
    base: dict[str, Any] = {"model": "tiny", "temperature": 0}
    if kind == "completion":
        base.update(prompt=PROMPT_IDS, max_tokens=6)
        return client.completions.create(**{**base, **fields}, extra_body=extra)
    base.update(messages=MESSAGES, max_tokens=6)
    return client.chat.completions.create(**{**base, **fields}, extra_body=extra)


def _text(response: Any, index: int = 0) -> str:
    choice = response.choices[index]
    return choice.text if hasattr(choice, "text") else choice.message.content


def refused(kind: str, value: Any) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        try:
            _create(client, kind, **{name: value})
        except openai.BadRequestError as exc:
            assert exc.body["param"] == name, (name, exc.body)
            assert name in exc.body["message"], (name, exc.body)
            return
        raise AssertionError(f"{name}={value!r} was neither honoured nor refused")
    return check


def accepted(kind: str, value: Any, reason: str) -> Check:
    """Cannot matter here (`reason`): the output is the one without the field."""
    def check(client: openai.OpenAI, name: str) -> None:
        assert reason
        assert _text(_create(client, kind, **{name: value})) == _text(_create(client, kind))
    return check


def _token_texts(kind: str, response: Any) -> list[str]:
    lp = response.choices[0].logprobs
    return lp.tokens if kind == "completion" else [c.token for c in lp.content]


def differs(kind: str, value: Any) -> Check:
    """Honoured (penalties): a greedy output that repeats tokens changes
    under the penalty (the exact rule is checked in tests/engine)."""
    def check(client: openai.OpenAI, name: str) -> None:
        wants = {"logprobs": 0} if kind == "completion" else {"logprobs": True}
        plain = _token_texts(kind, _create(client, kind, max_tokens=24, **wants))
        assert len(set(plain)) < len(plain), "the baseline must repeat a token"
        penalized = _token_texts(kind, _create(client, kind, max_tokens=24, **wants,
                                               **{name: value}))
        assert penalized != plain, name
    return check


def _max_tokens(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        assert _create(client, kind, **{name: 3}).usage.completion_tokens == 3
        refused(kind, 0)(client, name)
    return check


def _logit_bias(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        wants = {"logprobs": 1} if kind == "completion" else {"logprobs": True}
        forced = _create(client, kind, max_tokens=3, logit_bias={"50": 100}, **wants)
        plain = _create(client, kind, max_tokens=3, **wants)
        if kind == "completion":
            tokens, before = forced.choices[0].logprobs.tokens, plain.choices[0].logprobs.tokens
        else:
            tokens = [c.token for c in forced.choices[0].logprobs.content]
            before = [c.token for c in plain.choices[0].logprobs.content]
        assert len(set(tokens)) == 1 and tokens != before  # +100 on id 50: every token is 50
        refused(kind, {"5": 101})(client, name)
    return check


def _n(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        response = _create(client, kind, n=2)
        assert [c.index for c in response.choices] == [0, 1]
        assert response.usage.completion_tokens == 12
        refused(kind, 0)(client, name)
    return check


def _seed(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        runs = [_text(_create(client, kind, temperature=1.0, seed=s)) for s in (3, 3, 4, 5, 6)]
        assert runs[0] == runs[1] and len(set(runs[1:])) > 1
    return check


def _stop(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        text = _text(_create(client, kind))
        stop = text[len(text) // 2:][:2]
        cut = _create(client, kind, stop=[stop])
        assert _text(cut) == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    return check


def _stream(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        chunks = list(_create(client, kind, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 6
        assert name in ("stream", "stream_options")
    return check


def _temperature(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        hot = {_text(_create(client, kind, temperature=2.0, seed=s)) for s in range(3)}
        assert len(hot) > 1
        refused(kind, 2.5)(client, name)
    return check


def _top_p(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        # nucleus of one token: seeded sampling at temperature 1 is the greedy output
        assert _text(_create(client, kind, temperature=1.0, seed=1, top_p=1e-6)) == _text(
            _create(client, kind))
    return check


def _logprobs(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        if kind == "completion":
            lp = _create(client, kind, logprobs=2).choices[0].logprobs
            assert len(lp.top_logprobs) == 6 and all(len(t) <= 2 for t in lp.top_logprobs)
        else:
            lp = _create(client, kind, logprobs=True, top_logprobs=2).choices[0].logprobs
            assert len(lp.content) == 6 and all(len(c.top_logprobs) == 2 for c in lp.content)
    return check


def _response_format(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        boolean = {"type": "json_schema",
                   "json_schema": {"name": "b", "schema": {"type": "boolean"}}}
        for seed in range(3):
            text = _text(_create(client, kind, temperature=1.0, seed=seed, max_tokens=8,
                                 response_format=boolean))
            assert text in ("true", "false"), text
        try:  # a malformed one is refused naming where it is wrong
            _create(client, kind, response_format={"type": "json_schema",
                                                   "json_schema": {"name": "b", "schema": 3}})
        except openai.BadRequestError as exc:
            assert exc.body["param"] == "response_format.json_schema.schema", exc.body
            return
        raise AssertionError("a malformed response_format was served")
    return check


def _echo(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        plain = _text(_create(client, kind, prompt="Hello there"))
        echoed = _text(_create(client, kind, prompt="Hello there", echo=True))
        assert echoed == "Hello there" + plain, (echoed, plain)
    return check


def _model(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        try:
            _create(client, kind, model="other")
        except openai.NotFoundError as exc:
            assert exc.body["param"] == "model"
            return
        raise AssertionError("an unknown model was served")
    return check


def _required(kind: str) -> Check:
    """prompt / messages: the input itself; missing -> 400 naming it."""
    def check(client: openai.OpenAI, name: str) -> None:
        try:
            client.post("/completions" if kind == "completion" else "/chat/completions",
                        cast_to=object, body={"model": "tiny"})
        except openai.BadRequestError as exc:
            assert exc.body["param"] == name
            return
        raise AssertionError(f"a request without {name} was served")
    return check


def _top_k(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        # one candidate: seeded sampling at temperature 1 is the greedy output
        assert _text(_create(client, kind, temperature=1.0, seed=1, top_k=1)) == _text(
            _create(client, kind))
    return check


def _ignore_eos(kind: str, eos_id: int) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        forced = {"logit_bias": {str(eos_id): 100}}  # EOS is the greedy token at every step
        stopped = _create(client, kind, extra_body={"ignore_eos": False}, **forced)
        assert (stopped.usage.completion_tokens, stopped.choices[0].finish_reason) == (1, "stop")
        ignored = _create(client, kind, extra_body={"ignore_eos": True}, **forced)
        assert (ignored.usage.completion_tokens, ignored.choices[0].finish_reason) == (
            6, "length")
    return check


def _min_tokens(kind: str, eos_id: int) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        held = _create(client, kind, logit_bias={str(eos_id): 100}, min_tokens=3,
                       extra_body={"ignore_eos": False})
        assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (4, "stop")
        refused(kind, 7)(client, name)  # more than max_tokens (6)
    return check


def _stop_token_ids(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        forced = _create(client, kind, logit_bias={"50": 100}, stop_token_ids=[50])
        assert (forced.usage.completion_tokens, forced.choices[0].finish_reason) == (1, "stop")
        refused(kind, [-1])(client, name)
    return check


def _prompt_logprobs(kind: str) -> Check:
    def check(client: openai.OpenAI, name: str) -> None:
        entries = _create(client, kind, prompt_logprobs=1).choices[0].model_extra[name]
        assert len(entries) == len(PROMPT_IDS) and entries[0] is None
        assert all(str(token) in entries[i] for i, token in enumerate(PROMPT_IDS) if i)
    return check


def guided(kind: str, value: Any, valid: Callable[[str], bool], bad: Any) -> Check:
    """Honoured (a grammar): the random model's outputs at temperature 1
    are valid for every seed; `bad` is refused naming the field (for
    guided_json and guided_regex, by the compiler: the 400 names the field
    the grammar came from)."""
    def check(client: openai.OpenAI, name: str) -> None:
        for seed in range(3):
            text = _text(_create(client, kind, temperature=1.0, seed=seed, max_tokens=16,
                                 **{name: value}))
            assert valid(text), (name, seed, text)
        refused(kind, bad)(client, name)
    return check


def _guided(kind: str) -> dict[str, Check]:
    def one_of(options: tuple[Any, ...], parse: Callable[[str], Any]) -> Callable[[str], bool]:
        def valid(text: str) -> bool:
            try:
                return parse(text) in options
            except ValueError:
                return False
        return valid

    ok = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
    return {
        "guided_json": guided(kind, ok, one_of(({"ok": True}, {"ok": False}), json.loads),
                              {"type": "objectx"}),
        "guided_choice": guided(kind, ["red", "green", "blue"],
                                one_of(("red", "green", "blue"), str), []),
        "guided_regex": guided(kind, "[a-f0-9]{4}-(x|y)",
                               lambda text: re.fullmatch("[a-f0-9]{4}-(x|y)", text) is not None,
                               "[z-a]"),
        "guided_grammar": guided(kind, 'root ::= "yes" | "no"', one_of(("yes", "no"), str),
                                 "start: nothing"),
    }


def _common(kind: str) -> dict[str, Check]:
    return {
        "model": _model(kind),
        "max_tokens": _max_tokens(kind),
        "frequency_penalty": differs(kind, 2.0),
        "presence_penalty": differs(kind, 2.0),
        "logit_bias": _logit_bias(kind),
        "logprobs": _logprobs(kind),
        "n": _n(kind),
        "seed": _seed(kind),
        "stop": _stop(kind),
        "stream": _stream(kind),
        "stream_options": _stream(kind),
        "temperature": _temperature(kind),
        "top_p": _top_p(kind),
        "user": accepted(kind, "alice", "the session key of sticky routing; output unchanged"),
    }


def _extensions(kind: str, eos_id: int) -> dict[str, Check]:
    """The router's extensions of both endpoints (openai_fields.EXTENSIONS)."""
    return {
        "top_k": _top_k(kind),
        "ignore_eos": _ignore_eos(kind, eos_id),
        "repetition_penalty": differs(kind, 1.5),
        "min_tokens": _min_tokens(kind, eos_id),
        "stop_token_ids": _stop_token_ids(kind),
        "response_format": _response_format(kind),  # an extension on completions, as vLLM's
        "return_tokens_as_token_ids": tokens_as_ids(kind),
        **_guided(kind),
    }


def completion_fields(eos_id: int) -> dict[str, Check]:
    return {
        **_common("completion"),
        **_extensions("completion", eos_id),
        "prompt": _required("completion"),
        "best_of": refused("completion", 3),  # honoured only when == n (openai_fields)
        "suffix": refused("completion", "end"),
        "echo": _echo("completion"),
        "prompt_logprobs": _prompt_logprobs("completion"),
        # chat's own fields: a 400 saying they belong to /v1/chat/completions
        **{name: refused("completion", value) for name, value in CHAT_VALUES.items()},
        **{name: refused("completion", value) for name, value in UNKNOWN_FIELDS.items()},
    }


def chat_fields(eos_id: int) -> dict[str, Check]:
    return {
        **_common("chat"),
        **_extensions("chat", eos_id),
        "messages": _required("chat"),
        "max_completion_tokens": _max_tokens("chat"),
        "top_logprobs": _logprobs("chat"),
        "metadata": accepted("chat", {"k": "v"}, "tags for stored completions; nothing is stored"),
        "store": accepted("chat", True, "this server stores no completions"),
        "service_tier": accepted("chat", "auto", "one tier: every request is served alike"),
        "safety_identifier": accepted("chat", "id-1", "an abuse-tracking tag nothing here reads"),
        "prompt_cache_key": accepted("chat", "k", "prefix caching is automatic"),
        "prompt_cache_options": accepted("chat", {}, "prefix caching is automatic"),
        "prompt_cache_retention": accepted("chat", "24h", "the prefix cache keeps blocks (LRU)"),
        "prediction": accepted("chat", {"type": "content", "content": "x"},
                               "predicted outputs only change speed, never the output"),
        "audio": refused("chat", CHAT_VALUES["audio"]),
        "modalities": refused("chat", CHAT_VALUES["modalities"]),
        "moderation": refused("chat", {"policy": {}}),
        "reasoning_effort": refused("chat", "high"),
        "verbosity": refused("chat", "low"),
        "web_search_options": refused("chat", {}),
        # the tiny template cannot render tools or documents (see the module docstring)
        "tools": refused("chat", CHAT_VALUES["tools"]),
        "tool_choice": refused("chat", "auto"),
        "parallel_tool_calls": accepted("chat", True, "without tools there is no call to run in "
                                        "parallel; with them it is honoured (tests/router/tools)"),
        "documents": refused("chat", CHAT_VALUES["documents"]),
        "functions": refused("chat", [{"name": "f"}]),  # deprecated: send tools
        "function_call": refused("chat", "auto"),  # deprecated: send tool_choice
        # the completion fields: a 400 saying they belong to /v1/completions
        "prompt": refused("chat", "Hello"),
        "suffix": refused("chat", "end"),
        "prompt_logprobs": refused("chat", 1),
        "echo": refused("chat", True),  # vLLM's chat echo; only false is taken
        "best_of": refused("chat", 3),  # honoured only when == n, as on completions
        **{name: refused("chat", value) for name, value in UNKNOWN_FIELDS.items()},
    }
