"""POST /tokenize and POST /detokenize, as vLLM serves them.

    /tokenize    {"prompt": str, "add_special_tokens": bool = true}
                 or {"messages": [...], "add_generation_prompt": bool = true}
                 (the chat template is applied; it writes its own special
                 tokens), "model" optional
                 -> {"tokens": [ids], "count": n, "max_model_len": m}
    /detokenize  {"tokens": [ids], "model" optional} -> {"prompt": str}

The router's own tokenizer answers (the one that tokenizes generation
requests, so the ids are the ones a request would send). Every problem is a
400 naming the field and the limit: no or both inputs, a prompt or id list
that cannot fit the context (over the character limit, or more tokens than
max_model_len), ids that are not integers in the vocabulary. The handlers
in router.http.server read the body and run `tokenize_body` /
`detokenize_body` on the frontend's tokenizer threads (blocking: they
tokenize, off the event loop).
"""

from __future__ import annotations

from typing import Any

from router.api_error import bad_request
from router.frontend import Frontend
from router.generation import ParsedRequest
from router.http.requests import check_model, parse_chat


def _check_body(frontend: Frontend, body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad_request("'model' must be a string", "model")
        check_model(model, frontend.model_name)
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type(value).__name__}", name)
    return value


def _check_count(frontend: Frontend, count: int, field: str) -> None:
    if count > frontend.max_model_len:
        raise bad_request(f"'{field}' is {count} tokens, over the model's context of "
                          f"{frontend.max_model_len} tokens (max_model_len)", field)


def tokenize_body(frontend: Frontend, body: Any) -> dict[str, Any]:
    """The /tokenize answer for `body` (blocking); ApiError 400 on bad input."""
    body = _check_body(frontend, body)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("give exactly one of 'prompt' (a string) and 'messages' (a list)",
                          "prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise bad_request(f"'prompt' must be a string, got {type(prompt).__name__}",
                              "prompt")
        add_special = _flag(body, "add_special_tokens", True)
        parsed = ParsedRequest(kind="completion", model=frontend.model_name, prompt=prompt)
        frontend.limits.check_prompt_chars(parsed, frontend.max_model_len)
        tokens = frontend.tokenizer.encode(prompt, add_special_tokens=add_special)
        field = "prompt"
    else:
        parsed = parse_chat({"model": frontend.model_name, "messages": messages})
        frontend.limits.check_prompt_chars(parsed, frontend.max_model_len)
        chat = [{"role": m.role, "content": m.content} for m in parsed.messages]
        try:
            tokens = frontend.tokenizer.encode_chat(
                chat, add_generation_prompt=_flag(body, "add_generation_prompt", True))
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        field = "messages"
    _check_count(frontend, len(tokens), field)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": frontend.max_model_len}


def detokenize_body(frontend: Frontend, body: Any) -> dict[str, Any]:
    """The /detokenize answer for `body` (blocking); ApiError 400 on bad input."""
    body = _check_body(frontend, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' is required and must be a list of integer token ids",
                          "tokens")
    _check_count(frontend, len(tokens), "tokens")
    vocab = frontend.tokenizer.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"'tokens' holds {bad}, outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": frontend.tokenizer.decode(tokens)}
