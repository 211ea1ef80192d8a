"""Choosing the tool-call parser: the router's `--tool-call-parser` flag.

`llama3_json` and `hermes` name a parser; `auto` (the default) reads the
model's chat template: one that writes `<tool_call>` (Hermes, Qwen2.5,
Qwen3) gets `hermes`; one with Llama's `ipython` role or `<|python_tag|>`
(Llama 3.1-3.3 all have the role) gets `llama3_json`. A template showing
neither (Mistral's `[TOOL_CALLS]`, for one) has no known format: tool
requests are then refused with a 400 that names the flag, rather than
served with calls left unread in the content.
"""

from __future__ import annotations

from router.tools.base import ToolCallParser
from router.tools.hermes import OPEN_TAG, HermesParser
from router.tools.llama3_json import Llama3JsonParser

PARSERS: dict[str, type[ToolCallParser]] = {
    Llama3JsonParser.name: Llama3JsonParser,
    HermesParser.name: HermesParser,
}
TOOL_CALL_PARSER_CHOICES = ("auto", *PARSERS)


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's format calls for, or None when unknown."""
    if not chat_template:
        return None
    if OPEN_TAG in chat_template:
        return HermesParser.name
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return Llama3JsonParser.name
    return None


def resolve_parser(flag: str, chat_template: str | None) -> str | None:
    """The parser to use for `--tool-call-parser flag`; None = tools unsupported."""
    if flag == "auto":
        return detect_parser(chat_template)
    if flag not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSER_CHOICES)}, "
                         f"got {flag!r}")
    return flag


def make_parser(name: str, *, max_calls: int | None = None) -> ToolCallParser:
    return PARSERS[name](max_calls=max_calls)
