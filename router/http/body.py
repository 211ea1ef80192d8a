"""`read_json`: a request body read and parsed with every hostile case refused
in OpenAI's error shape, never a 500. Called by the generation handlers
(router.http.server) on the event loop, before the body is validated field by
field (router.http.requests). The body is read on the event loop; the CPU
work (depth check, parse, text check) of a body over `INLINE_BODY_BYTES`
runs on the caller's thread pool, so a large body delays only its own
request (a small one parses in well under a millisecond, inline).

    body over InputLimits.max_body_bytes  -> 413 request_too_large (aiohttp
                                             stops reading at the limit)
    nested deeper than max_json_depth     -> 400 json_too_deep (checked on the
                                             raw bytes, before the parser recurses)
    not JSON, not UTF-8, a number the
    parser refuses (over 4300 digits)     -> 400
    a lone UTF-16 surrogate in any string
    (valid JSON, not valid Unicode text)  -> 400 naming the field
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.api_error import ApiError, bad_request
from router.limits import MAX_BODY_BYTES_PER_TOKEN, InputLimits

# A JSON string literal (escapes included), to blank out before counting brackets.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE = re.compile("[\ud800-\udfff]")
INLINE_BODY_BYTES = 64 * 1024


# Runs a blocking call off the event loop (router.frontend.Frontend.run_blocking).
RunBlocking = Callable[..., Awaitable[Any]]


async def read_json(request: web.Request, limits: InputLimits, max_model_len: int,
                    run_blocking: RunBlocking) -> Any:
    """The parsed body; ApiError (413 / 400) for everything in the module docstring."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413, f"the request body is over the limit of {limits.max_body_bytes} bytes "
                 f"(max_model_len {max_model_len} x {MAX_BODY_BYTES_PER_TOKEN} bytes per token "
                 "+ 64 KiB): it cannot fit the context",
            error_type="invalid_request_error", code="request_too_large") from None
    if len(raw) <= INLINE_BODY_BYTES:
        return parse_json(raw, limits.max_json_depth)
    return await run_blocking(parse_json, raw, limits.max_json_depth)


def parse_json(raw: bytes, max_depth: int) -> Any:
    """`raw` parsed, or ApiError 400 (too deep, not JSON, not UTF-8, a lone surrogate)."""
    if nests_deeper_than(raw, max_depth):
        raise ApiError(400, f"the request body nests JSON more than {max_depth} levels "
                            f"deep (the limit is {max_depth})", code="json_too_deep")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, or a number json refuses
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    check_text(body)
    return body


def nests_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether `raw`'s arrays and objects nest more than `limit` levels deep
    (brackets inside strings do not count). Linear; stops at the first level
    past the limit."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # too few brackets to nest past the limit: the usual body
    depth = 0
    for byte in _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        if depth > limit:
            return True
    return False


def check_text(value: Any, path: str = "") -> None:
    """400 naming the field when any string (or key) of a parsed body holds a
    lone surrogate: JSON allows "\\ud800", Unicode text does not, and nothing
    downstream (tokenizer, protobuf) could encode it."""
    if isinstance(value, str):
        if not value.isascii() and (found := _SURROGATE.search(value)) is not None:
            field = path or "the request body"
            raise bad_request(
                f"'{field}' is not valid Unicode text: it holds a lone UTF-16 surrogate "
                f"(\\u{ord(found.group()):04x} at character {found.start()})", path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, path)
            check_text(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_text(item, f"{path}[{index}]")
