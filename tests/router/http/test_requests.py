"""Request parsing and validation: every bad field gives a 400 naming it and the limit."""

from __future__ import annotations

import pytest

from router.api_error import ApiError
from router.generation import ChatMessage
from router.http.requests import check_model, parse_chat, parse_completion


def _completion(**fields):
    return {"model": "tiny", "prompt": "hello", **fields}


def _chat(**fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_completion_defaults_and_fields():
    parsed = parse_completion(
        _completion(max_tokens=5, temperature=0, top_p=0.5, top_k=3, seed=7, stop="\n",
                    ignore_eos=True, logprobs=2, user="alice", stream=True,
                    stream_options={"include_usage": True})
    )
    assert parsed.kind == "completion"
    assert parsed.prompt == "hello" and parsed.prompt_token_ids is None
    sampling = parsed.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (
        5, 0.0, 0.5, 3)
    assert (sampling.seed, sampling.stop, sampling.ignore_eos, sampling.logprobs) == (
        7, ("\n",), True, 2)
    assert (parsed.user, parsed.stream, parsed.include_usage) == ("alice", True, True)


def test_completion_token_prompt_and_batch_of_one():
    assert parse_completion(_completion(prompt=[1, 2, 3])).prompt_token_ids == (1, 2, 3)
    assert parse_completion(_completion(prompt=["only"])).prompt == "only"
    assert parse_completion(_completion(prompt=[[4, 5]])).prompt_token_ids == (4, 5)
    assert parse_completion(_completion(top_k=-1)).sampling.top_k == 0


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be at least 1, got 0"),
        ({"max_tokens": -3}, "max_tokens", "at least 1, got -3"),
        ({"max_tokens": "5"}, "max_tokens", "'max_tokens' must be an integer, got str"),
        ({"max_tokens": True}, "max_tokens", "must be an integer, got bool"),
        ({"temperature": -0.1}, "temperature", "'temperature' must be in [0, 2], got -0.1"),
        ({"temperature": 2.5}, "temperature", "in [0, 2], got 2.5"),
        ({"temperature": "hot"}, "temperature", "'temperature' must be a number, got str"),
        ({"top_p": 0}, "top_p", "'top_p' must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p", "in (0, 1], got 1.5"),
        ({"n": 17}, "n", "'n' must be an integer in [1, 16], got 17"),
        ({"n": 2, "best_of": 3}, "best_of", "'best_of' must equal n (2)"),
        ({"max_completion_tokens": 5}, "max_completion_tokens",
         "is a /v1/chat/completions field"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "values must be in [-100, 100]"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "must be at most max_tokens (10)"),
        ({"stop_token_ids": [-1]}, "stop_token_ids",
         "'stop_token_ids' must be token ids in [0, 2147483647], got [-1]"),
        ({"repetition_penalty": 0}, "repetition_penalty",
         "'repetition_penalty' must be in (0, 1000000] (1 = off), got 0.0"),
        ({"logprobs": 21}, "logprobs", "'logprobs' must be in [0, 20], got 21"),
        ({"logprobs": True}, "logprobs", "'logprobs' must be an integer, got bool"),
        ({"seed": -1}, "seed", "'seed' must be in [0, 18446744073709551615], got -1"),
        ({"stop": 5}, "stop", "'stop' must be a string or a list of strings"),
        ({"stop": [""]}, "stop", "'stop' strings must not be empty"),
        ({"stream": "yes"}, "stream", "'stream' must be a boolean, got str"),
        ({"stream_options": {"include_usage": True}}, "stream_options",
         "only allowed when 'stream' is true"),
        ({"presence_penalty": 2.5}, "presence_penalty", "'presence_penalty' must be in [-2, 2]"),
        ({"suffix": "x"}, "suffix", "'suffix' is not supported"),
        ({"echo": "yes"}, "echo", "'echo' must be a boolean, got str"),
        ({"prompt_logprobs": 21}, "prompt_logprobs",
         "'prompt_logprobs' must be in [0, 20], got 21"),
        ({"max_tokens": 0, "logprobs": 1}, "max_tokens",
         "'max_tokens' must be at least 1, got 0 (0 only scores the prompt: with 'echo': "
         "true or 'prompt_logprobs')"),
        ({"prompt": None}, "prompt", "'prompt' is required"),
        ({"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
        ({"prompt": [1, -2]}, "prompt", "non-empty list of token ids"),
        ({"prompt": 12}, "prompt", "must be a string or a non-empty list"),
        ({"model": ""}, "model", "'model' is required"),
        ({"user": 3}, "user", "'user' must be a string, got int"),
    ],
)
def test_completion_rejects(fields, param, fragment):
    with pytest.raises(ApiError) as info:
        parse_completion(_completion(**fields))
    err = info.value
    assert err.status == 400
    assert err.param == param
    assert fragment in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_body_must_be_object():
    with pytest.raises(ApiError, match="the request body must be a JSON object"):
        parse_completion([1, 2])


def test_chat_fields():
    parsed = parse_chat(
        _chat(messages=[{"role": "system", "content": "be brief"},
                        {"role": "user", "content": [{"type": "text", "text": "a"},
                                                     {"type": "text", "text": "b"}]}],
              max_completion_tokens=9, max_tokens=3, logprobs=True, top_logprobs=4)
    )
    assert parsed.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "ab"))
    assert parsed.sampling.max_tokens == 9  # max_completion_tokens wins over the legacy field
    assert parsed.sampling.logprobs == 4
    assert parse_chat(_chat(logprobs=True)).sampling.logprobs == 0
    assert parse_chat(_chat()).sampling.logprobs is None


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"messages": []}, "messages", "'messages' is required and must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
         "must be one of system, developer, user, assistant, tool, got 'robot'"),
        ({"messages": ["hi"]}, "messages[0]", "'messages[0]' must be an object"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content", "other content types are not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true"),
        ({"logprobs": 1}, "logprobs", "'logprobs' must be a boolean, got int"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "at least 1, got 0"),
    ],
)
def test_chat_rejects(fields, param, fragment):
    with pytest.raises(ApiError) as info:
        parse_chat(_chat(**fields))
    assert (info.value.status, info.value.param) == (400, param)
    assert fragment in info.value.message


def test_check_model():
    check_model("tiny", "tiny")
    with pytest.raises(ApiError) as info:
        check_model("gpt-4", "tiny")
    assert info.value.status == 404
    assert info.value.body() == {
        "error": {
            "message": "The model 'gpt-4' does not exist; this server serves 'tiny'",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_echo_and_prompt_logprobs_ask_the_pods_for_prompt_logprobs():
    def sampling(**fields):
        return parse_completion({"model": "m", "prompt": "hi", **fields}).sampling

    echoed = sampling(echo=True, logprobs=2, max_tokens=0)
    assert (echoed.echo, echoed.prompt_logprobs, echoed.max_tokens) == (True, 2, 0)
    assert sampling(echo=True).prompt_logprobs is None  # the text only
    assert sampling(prompt_logprobs=0, max_tokens=0).prompt_logprobs == 0
    assert sampling(echo=True, logprobs=1, prompt_logprobs=4).prompt_logprobs == 4
    assert sampling(logprobs=3).prompt_logprobs is None  # no echo: outputs only
    with pytest.raises(ApiError, match="'prompt_logprobs' is a /v1/completions field; "
                                       "/v1/chat/completions does not take it"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                    "prompt_logprobs": 1})
    with pytest.raises(ApiError, match="'echo' is not supported"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                    "echo": True})


# vLLM's sampling fields this server does not honour, a vLLM chat field, a
# typo, and a body field no one documents: each a 400 naming it.
UNKNOWN = [("min_p", 0.1), ("use_beam_search", True), ("skip_special_tokens", False),
           ("chat_template_kwargs", {"enable_thinking": False}),
           ("add_generation_prompt", False), ("guided_decoding_backend", "xgrammar"),
           ("typo_field", 1), ("temprature", 0.5)]


@pytest.mark.parametrize(("name", "value"), UNKNOWN)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_unknown_fields_are_a_400_naming_them(kind, name, value):
    parse, endpoint = ((parse_completion, "/v1/completions") if kind == "completion"
                       else (parse_chat, "/v1/chat/completions"))
    body = _completion(**{name: value}) if kind == "completion" else _chat(**{name: value})
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.body() == {"error": {
        "message": f"Unrecognized request argument supplied: '{name}' ({endpoint} refuses the "
                   "fields it does not honour rather than ignore them)",
        "type": "invalid_request_error", "param": name, "code": None}}


def test_unknown_field_hints_and_null_values():
    with pytest.raises(ApiError) as info:
        parse_chat(_chat(extra_body={"min_p": 0.1}))
    assert info.value.param == "extra_body"
    assert info.value.message.endswith(
        "rather than ignore them; the openai client's extra_body={...} sends its keys as "
        "top-level fields)")
    with pytest.raises(ApiError) as info:
        parse_completion(_completion(session_id="s1"))
    assert info.value.param == "session_id"
    assert info.value.message.endswith(
        "; the session id is 'user' or the x-session-id header)")
    # null is "not set", for unknown fields as for OpenAI's own
    assert parse_chat(_chat(min_p=None, prompt=None)).sampling == parse_chat(_chat()).sampling
    # the first unknown field in the body's order is the one named
    with pytest.raises(ApiError) as info:
        parse_completion({"zeta": 1, "model": "tiny", "prompt": "p", "alpha": 2})
    assert info.value.param == "zeta"


@pytest.mark.parametrize(("name", "value"), [
    ("messages", [{"role": "user", "content": "hi"}]), ("tools", []), ("tool_choice", "none"),
    ("parallel_tool_calls", False), ("documents", [{"text": "d"}]),
    ("max_completion_tokens", 5), ("top_logprobs", 2), ("store", True),
    ("metadata", {"k": "v"}), ("audio", {"voice": "alloy"}),
])
def test_chat_fields_on_completions_are_a_400_naming_them(name, value):
    with pytest.raises(ApiError) as info:
        parse_completion(_completion(**{name: value}))
    assert (info.value.status, info.value.param) == (400, name)
    assert info.value.message == (f"'{name}' is a /v1/chat/completions field; "
                                  "/v1/completions does not take it")


@pytest.mark.parametrize(("name", "value"), [
    ("prompt", "hello"), ("suffix", "end"), ("prompt_logprobs", 1),
])
def test_completion_fields_on_chat_are_a_400_naming_them(name, value):
    with pytest.raises(ApiError) as info:
        parse_chat(_chat(**{name: value}))
    assert (info.value.status, info.value.param) == (400, name)
    assert info.value.message == (f"'{name}' is a /v1/completions field; "
                                  "/v1/chat/completions does not take it")


def test_extensions_and_fields_of_both_endpoints_are_known():
    extensions = dict(top_k=2, ignore_eos=True, repetition_penalty=1.1, min_tokens=1,
                      stop_token_ids=[7], max_tokens=4, best_of=1, n=1)
    completion = parse_completion(_completion(**extensions, echo=False, prompt_logprobs=0))
    chat = parse_chat(_chat(**extensions, echo=False, documents=[{"text": "d"}]))
    for sampling in (completion.sampling, chat.sampling):
        assert (sampling.top_k, sampling.ignore_eos, sampling.repetition_penalty,
                sampling.min_tokens, sampling.stop_token_ids) == (2, True, 1.1, 1, (7,))
    assert chat.documents == ({"text": "d"},)
