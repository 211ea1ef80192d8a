"""`Llama3JsonParser`: Llama 3.x's JSON tool calls.

Llama 3.1/3.2/3.3 instruct models answer a tool request with the call as the
whole reply: `{"name": "f", "parameters": {...}}` (some fine-tunes write
`"arguments"`), several separated by `;` or whitespace; otherwise they
answer in text. So a reply is read as calls only when its first
non-whitespace character is `{`; any other reply is content from its first
character. A `{` reply that does not turn out to be a call (the user asked
for JSON) is shown as content unchanged. Text after the calls is content.
(`<|python_tag|>`, Llama's built-in-tool marker, is a special token the
detokenizer drops, so a call after it reads the same.)
"""

from __future__ import annotations

import enum

from router.tools.base import WHITESPACE, ContentOut, ToolCallParser, ToolEvent
from router.tools.json_call import CallScanner

_BETWEEN_CALLS = WHITESPACE + ";,"


class _State(enum.Enum):
    START = "start"  # before the first non-whitespace character
    CALL = "call"
    BETWEEN = "between"  # after a call: another, or text
    CONTENT = "content"  # the rest is text
    DISCARD = "discard"  # max_calls reached: the rest is dropped


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"

    def __init__(self, *, max_calls: int | None = None) -> None:
        super().__init__(max_calls=max_calls)
        self._state = _State.START
        self._content = ContentOut()
        self._scanner: CallScanner | None = None

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while text:
            text = self._step(text, events)
        return events

    def _step(self, text: str, events: list[ToolEvent]) -> str:
        """Consume some of `text` in the current state; return what is left."""
        if self._state in (_State.START, _State.BETWEEN):
            skip = WHITESPACE if self._state is _State.START else _BETWEEN_CALLS
            body = text.lstrip(skip)
            if self._state is _State.START:
                self._content.text(text[:len(text) - len(body)], events)
            if not body:
                return ""
            if body[0] != "{":
                self._state = _State.CONTENT
            elif self.calls_exhausted:
                self._state = _State.DISCARD
            else:
                self._scanner = CallScanner(self.num_calls)
                self._state = _State.CALL
            return body
        if self._state is _State.CALL:
            assert self._scanner is not None
            self._scan_call(self._scanner, self._content, text, events)
            if self._scanner.failed:
                self._content.text(self._scanner.raw, events)
                self._state = _State.CONTENT
                return self._scanner.rest
            if self._scanner.done:
                self._state = _State.BETWEEN
                return self._scanner.rest
            return ""
        if self._state is _State.CONTENT:
            self._content.text(text, events)
        return ""

    def finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._state is _State.CALL:
            assert self._scanner is not None
            self._content.text(self._scanner.pending_text(), events)
        self._content.finish(self.num_calls, events)
        return events
