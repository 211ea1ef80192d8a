"""`HermesParser`: Hermes/Qwen tool calls, `<tool_call>{json}</tool_call>`.

Hermes-style models (NousResearch Hermes 2/3, Qwen2.5, Qwen3) write each call
as `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, possibly
after some text and several in a row. Text outside the tags is content;
whatever could be the start of `<tool_call>` is held back until decided. A
tag whose body is not a call is shown as content, tag included; a missing
closing tag (the output ended, or text follows directly) is tolerated.
"""

from __future__ import annotations

import enum

from router.tools.base import WHITESPACE, ContentOut, ToolCallParser, ToolEvent
from router.tools.json_call import CallScanner

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class _State(enum.Enum):
    CONTENT = "content"
    CALL = "call"  # inside <tool_call>, reading the JSON
    CLOSE = "close"  # after the JSON, expecting </tool_call>
    DISCARD = "discard"  # max_calls reached: the rest is dropped


class HermesParser(ToolCallParser):
    name = "hermes"

    def __init__(self, *, max_calls: int | None = None) -> None:
        super().__init__(max_calls=max_calls)
        self._state = _State.CONTENT
        self._content = ContentOut()
        self._held = ""  # a possible tag prefix
        self._scanner: CallScanner | None = None

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while text:
            text = self._step(text, events)
        return events

    def _step(self, text: str, events: list[ToolEvent]) -> str:
        """Consume some of `text` in the current state; return what is left."""
        if self._state is _State.CONTENT:
            text, self._held = self._held + text, ""
            at = text.find(OPEN_TAG)
            if at < 0:
                keep = _held_prefix(text, OPEN_TAG)
                self._content.text(text[:len(text) - keep], events)
                self._held = text[len(text) - keep:]
                return ""
            self._content.text(text[:at], events)
            if self.calls_exhausted:
                self._state = _State.DISCARD
                return ""
            self._scanner = CallScanner(self.num_calls)
            self._state = _State.CALL
            return text[at + len(OPEN_TAG):]
        if self._state is _State.CALL:
            assert self._scanner is not None
            self._scan_call(self._scanner, self._content, text, events)
            if self._scanner.failed:
                self._content.text(OPEN_TAG + self._scanner.raw, events)
                self._state = _State.CONTENT
                return self._scanner.rest
            if self._scanner.done:
                self._state = _State.CLOSE
                return self._scanner.rest
            return ""
        if self._state is _State.CLOSE:
            text, self._held = self._held + text, ""
            body = text.lstrip(WHITESPACE)
            if body.startswith(CLOSE_TAG):
                self._state = _State.CONTENT
                return body[len(CLOSE_TAG):]
            if CLOSE_TAG.startswith(body):  # empty or a prefix of the tag
                self._held = text
                return ""
            self._state = _State.CONTENT  # no closing tag: go on with the text
            return body
        return ""

    def finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._state is _State.CONTENT:
            self._content.text(self._held, events)
        elif self._state is _State.CALL:
            assert self._scanner is not None
            pending = self._scanner.pending_text()
            if not self._scanner.started:
                self._content.text(OPEN_TAG + pending, events)
        self._held = ""
        self._content.finish(self.num_calls, events)
        return events
