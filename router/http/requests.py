"""Parsing and validation of OpenAI requests into typed, checked dataclasses.

Called by the HTTP handlers (router.http.server) on the event loop, once per
request, before anything is sent to a pod. Every problem raises `ApiError`
(400, or 404 for an unknown model) whose message names the field and the
allowed range, in OpenAI's error shape; nothing here touches the network.

Two steps, because some limits depend on the prompt's token count:

1. `parse_completion(body)` / `parse_chat(body)` check the JSON fields and
   return a `ParsedRequest` (prompt not yet tokenized).
2. `resolve_sampling(parsed, num_prompt_tokens, max_model_len)` applies the
   defaults and the context limit and returns the `SamplingSpec` the flow
   sends to the pods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from router.api_error import ApiError, bad_request

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_SEED = 2**64 - 1
DEFAULT_COMPLETION_MAX_TOKENS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant")
# Fields accepted only at their neutral value: the pods cannot honour others.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "echo": False}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Sampling for one request, limits already checked; maps 1:1 onto
    `pdserve.v1.SamplingParams`. `logprobs` None = off, else the number of
    top alternatives per token (0 = only the sampled token's logprob)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated completion or chat request, prompt not yet tokenized.

    Exactly one of `prompt` (text), `prompt_token_ids` (completions with a
    token list) and `messages` (chat) carries the input. `max_tokens` None
    means "the default for this endpoint" (see `resolve_sampling`).
    """

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] = ()
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("completion", "chat"):
            raise ValueError(f"kind must be 'completion' or 'chat', got {self.kind!r}")
        inputs = (self.prompt is not None) + (self.prompt_token_ids is not None)
        inputs += bool(self.messages)
        if inputs != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids, messages must be set")


# ---------------------------------------------------------------- field readers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int_field(body: dict, name: str, low: int, high: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be in [{low}, {high}], got {value}", name)
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


def _common_fields(body: Any) -> dict[str, Any]:
    """Fields shared by both endpoints; returns ParsedRequest keyword arguments."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    for name, neutral in _NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise bad_request(f"'{name}' is not supported (only {neutral!r})", name)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request(
            f"'n' must be 1: several choices per request are not supported, got {n!r}", "n"
        )
    temperature = _number_field(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_p = _number_field(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _int_field(body, "top_k", -1, 2**31 - 1, 0)
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
    return dict(
        model=model,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),  # -1 means off, as in vLLM
        seed=_int_field(body, "seed", 0, MAX_SEED, None),
        stop=_stop_field(body.get("stop")),
        ignore_eos=_bool_field(body, "ignore_eos"),
        stream=stream,
        include_usage=include_usage,
        user=user or None,
    )


def _stop_field(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(
            f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop"
        )
    if any(not s for s in stops):
        raise bad_request("'stop' strings must not be empty", "stop")
    return tuple(stops)


def _max_tokens_field(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if value <= 0:
        raise bad_request(f"'{name}' must be at least 1, got {value}", name)
    return value


# ---------------------------------------------------------------- endpoints


def parse_completion(body: Any) -> ParsedRequest:
    """Validate a /v1/completions body (or raise ApiError 400)."""
    fields = _common_fields(body)
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
    logprobs = _int_field(body, "logprobs", 0, MAX_LOGPROBS, None)
    if body.get("suffix") is not None:
        raise bad_request("'suffix' is not supported", "suffix")
    return ParsedRequest(
        kind="completion",
        prompt=text,
        prompt_token_ids=token_ids,
        max_tokens=_max_tokens_field(body, "max_tokens"),
        logprobs=logprobs,
        **fields,
    )


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


def parse_chat(body: Any) -> ParsedRequest:
    """Validate a /v1/chat/completions body (or raise ApiError 400)."""
    fields = _common_fields(body)
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
        messages.append(ChatMessage(role=role, content=_message_content(raw.get("content"), i)))
    want_logprobs = _bool_field(body, "logprobs")
    top = _int_field(body, "top_logprobs", 0, MAX_LOGPROBS, None)
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    max_tokens = _max_tokens_field(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _max_tokens_field(body, "max_tokens")
    return ParsedRequest(
        kind="chat",
        messages=tuple(messages),
        max_tokens=max_tokens,
        logprobs=(top or 0) if want_logprobs else None,
        **fields,
    )


def resolve_sampling(
    parsed: ParsedRequest, num_prompt_tokens: int, max_model_len: int
) -> SamplingSpec:
    """Apply defaults and the context limit; raise ApiError 400 naming the limit.

    Completions default to 16 new tokens (OpenAI's default), chat to
    whatever room the context has left after the prompt.
    """
    if num_prompt_tokens < 1:
        raise bad_request("the prompt is empty after tokenization", "prompt")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"the prompt is {num_prompt_tokens} tokens, which leaves no room in the model's "
            f"context of {max_model_len} tokens",
            "messages" if parsed.kind == "chat" else "prompt",
        )
    max_tokens = parsed.max_tokens
    if max_tokens is None:
        max_tokens = room if parsed.kind == "chat" else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    elif max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; the prompt is "
            f"{num_prompt_tokens} tokens and max_tokens is {max_tokens} "
            f"({num_prompt_tokens + max_tokens} in total): lower max_tokens to at most {room}",
            "max_tokens",
        )
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        top_k=parsed.top_k,
        seed=parsed.seed,
        stop=parsed.stop,
        ignore_eos=parsed.ignore_eos,
        logprobs=parsed.logprobs,
    )


def check_model(model: str, served_name: str) -> None:
    """404 model_not_found unless `model` is the one this router serves."""
    if model != served_name:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{served_name}'",
            param="model",
            code="model_not_found",
        )
