"""OpenAI request bodies -> `ParsedRequest`, with the JSON checked.

Called by the HTTP handlers (router.http.server) on the event loop, once per
request, before anything is sent to a pod; the gRPC front door
(router.grpc_server) reuses it for the prompt and messages of its requests.
Every problem raises `ApiError` (400, or 404 for an unknown model) whose
message names the field and the allowed range, in OpenAI's error shape;
nothing here touches the network.

Here the JSON types are checked and the OpenAI fields become a
`SamplingSpec` (`_sampling`: the one OpenAI -> SamplingSpec conversion);
the limits of the values are `SamplingSpec`'s to check (router.sampling),
and the context limit, which needs the tokenized prompt, is applied by
`router.frontend.Frontend.prepare`.
"""

from __future__ import annotations

import math
from typing import Any

from engine.grammar import GrammarSpec
from router.api_error import ApiError, bad_request
from router.generation import ChatMessage, ParsedRequest
from router.http.openai_fields import check_known, check_refused, choice_count, logits_fields
from router.sampling import SamplingError, SamplingSpec
from router.structured_output import grammar_from_body
from router.tools.request import parse_documents, parse_message_tool_fields, parse_tool_request

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# ---------------------------------------------------------------- field readers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int_field(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {type(value).__name__}", name)
    return value


def _number_field(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise bad_request(f"'{name}' must be a number, got {type(value).__name__}", name)
    return float(value)


def _bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type(value).__name__}", name)
    return value


def _stop_field(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    return tuple(stops)


def _sampling(body: dict, kind: str, grammar: GrammarSpec | None) -> SamplingSpec:
    """The OpenAI fields as a SamplingSpec (with `grammar`, read by
    router.structured_output); its limits are checked there and worded with
    the name the client used for the field."""
    names: dict[str, str] = {}  # SamplingSpec field -> the body's name for it
    if kind == "chat":
        want_logprobs = _bool_field(body, "logprobs")
        top = _int_field(body, "top_logprobs")
        if top is not None and not want_logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        logprobs = (top or 0) if want_logprobs else None
        names["logprobs"] = "top_logprobs"
        max_tokens = _int_field(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens")
        else:
            names["max_tokens"] = "max_completion_tokens"
        echo, prompt_logprobs = False, None
    else:
        logprobs = _int_field(body, "logprobs")
        max_tokens = _int_field(body, "max_tokens")
        echo = _bool_field(body, "echo")
        prompt_logprobs = _int_field(body, "prompt_logprobs")
    try:
        return SamplingSpec(
            max_tokens=max_tokens,
            temperature=_number_field(body, "temperature", 1.0),
            top_p=_number_field(body, "top_p", 1.0),
            top_k=_int_field(body, "top_k") or 0,
            seed=_int_field(body, "seed"),
            stop=_stop_field(body.get("stop")),
            ignore_eos=_bool_field(body, "ignore_eos"),
            logprobs=logprobs,
            grammar=grammar,
            **logits_fields(body),
            prompt_logprobs=_prompt_logprobs(echo, logprobs, prompt_logprobs),
            echo=echo,
        )
    except SamplingError as exc:
        raise exc.to_api_error(names.get(exc.field, exc.field)) from None


def _prompt_logprobs(echo: bool, logprobs: int | None, prompt_logprobs: int | None) -> int | None:
    """How many alternatives the pods compute per prompt token: `echo` with
    `logprobs` n shows the prompt's tokens with n alternatives (OpenAI's
    legacy echo), `prompt_logprobs` m (vLLM's) with m; the larger of both."""
    wanted = [n for n in (logprobs if echo else None, prompt_logprobs) if n is not None]
    return max(wanted) if wanted else None


def _common_fields(body: Any, kind: str, sampling: SamplingSpec | None) -> dict[str, Any]:
    """Fields shared by both endpoints; returns ParsedRequest keyword arguments."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    check_known(body, kind)
    check_refused(body, kind)
    n = choice_count(body)
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _bool_field(options, "include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"'user' must be a string, got {type(user).__name__}", "user")
    grammar = grammar_from_body(body) if sampling is None else None
    return dict(
        model=model,
        sampling=(sampling if sampling is not None
                  else _sampling(body, kind, grammar.spec if grammar else None)),
        grammar_field=grammar.field if grammar else None,
        stream=stream,
        include_usage=include_usage,
        user=user or None,
        n=n,
        tokens_as_ids=_bool_field(body, "return_tokens_as_token_ids"),
    )


# ---------------------------------------------------------------- endpoints


def parse_completion(body: Any, sampling: SamplingSpec | None = None) -> ParsedRequest:
    """Validate a /v1/completions body (or raise ApiError 400). `sampling`
    given (the gRPC front door's, from SamplingParams) replaces the body's
    sampling fields."""
    fields = _common_fields(body, "completion", sampling)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is the same request
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        token_ids = tuple(prompt)
    elif prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise bad_request(
            "'prompt' must be one string: batched prompts are not supported", "prompt"
        )
    else:
        raise bad_request(
            "'prompt' must be a string or a non-empty list of token ids (integers >= 0)", "prompt"
        )
    return ParsedRequest(kind="completion", prompt=text, prompt_token_ids=token_ids, **fields)


def _message_content(raw: Any, index: int) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        texts = []
        for part in raw:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                raise bad_request(
                    f"'messages[{index}].content' parts must be {{\"type\": \"text\", \"text\": "
                    "string}: other content types are not supported",
                    f"messages[{index}].content",
                )
            texts.append(part["text"])
        return "".join(texts)
    if raw is None:
        return ""
    raise bad_request(
        f"'messages[{index}].content' must be a string or a list of text parts",
        f"messages[{index}].content",
    )


def parse_chat(body: Any, sampling: SamplingSpec | None = None) -> ParsedRequest:
    """Validate a /v1/chat/completions body (or raise ApiError 400); `sampling`
    as in `parse_completion`."""
    fields = _common_fields(body, "chat", sampling)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("'messages' is required and must be a non-empty list", "messages")
    messages = []
    for i, raw in enumerate(raw_messages):
        if not isinstance(raw, dict):
            raise bad_request(f"'messages[{i}]' must be an object", f"messages[{i}]")
        role = raw.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                f"messages[{i}].role",
            )
        tool_fields = parse_message_tool_fields(raw, role, i)
        content: str | None = _message_content(raw.get("content"), i)
        if raw.get("content") is None and tool_fields.get("tool_calls"):
            content = None  # a turn that only calls tools: templates test `message.content`
        messages.append(ChatMessage(role=role, content=content, **tool_fields))
    return ParsedRequest(kind="chat", messages=tuple(messages), tools=parse_tool_request(body),
                         documents=parse_documents(body), **fields)


def check_model(model: str, served_name: str) -> None:
    """404 model_not_found unless `model` is the one this router serves."""
    if model != served_name:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{served_name}'",
            param="model",
            code="model_not_found",
        )
