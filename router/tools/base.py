"""The tool-call parser interface and the events it emits.

A `ToolCallParser` is fed the generated text of ONE request in the pieces
the detokenizer produces (`feed`), then `finish`ed once; it returns the
events in output order. The parsers are incremental and split-invariant:
feeding a text in any pieces gives events whose concatenated content, call
names and concatenated arguments equal those of feeding it whole (tests
check every split point). Text that could still be the start of a call is
held back until it is decided.

Owned by one request (`router.tools.extractor.ToolCallExtractor`), used on
the router's event loop; not thread-safe.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol

WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class ContentText:
    """Plain assistant text (not part of a call)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """Call number `index` (0, 1, ...) begins; its name is known."""

    index: int
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    """More of call `index`'s arguments (a JSON object's text, in pieces)."""

    index: int
    fragment: str


ToolEvent = ContentText | CallStart | CallArguments


class CallReader(Protocol):
    """Reads one call's text as it arrives (`router.tools.json_call.CallScanner`)."""

    def feed(self, text: str) -> list[ToolEvent]: ...


class ContentOut:
    """Emits content text, holding back trailing whitespace: whitespace just
    before a call, between calls or after the last call is dropped, so a reply
    that is only calls has no content; otherwise it is emitted when more text
    (or the end, with no call) follows."""

    def __init__(self) -> None:
        self._held_space = ""

    def text(self, text: str, events: list[ToolEvent]) -> None:
        if not text:
            return
        body = text.rstrip(WHITESPACE)
        if body:
            events.append(ContentText(self._held_space + body))
            self._held_space = ""
        self._held_space += text[len(body):]

    def drop_space(self) -> None:
        self._held_space = ""

    def finish(self, num_calls: int, events: list[ToolEvent]) -> None:
        if num_calls == 0 and self._held_space:
            events.append(ContentText(self._held_space))
        self._held_space = ""


class ToolCallParser(abc.ABC):
    """Finds tool calls in one request's generated text.

    `max_calls` 1 (`parallel_tool_calls: false`) ends parsing after the first
    call: the text after it is dropped."""

    name: str = ""

    def __init__(self, *, max_calls: int | None = None) -> None:
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"max_calls must be >= 1 or None, got {max_calls}")
        self.max_calls = max_calls
        self.num_calls = 0  # calls started so far

    @property
    def calls_exhausted(self) -> bool:
        return self.max_calls is not None and self.num_calls >= self.max_calls

    def _scan_call(self, scanner: CallReader, content: ContentOut, text: str,
                   events: list[ToolEvent]) -> None:
        """Feed `text` to the call being read; its events go to `events`."""
        new = scanner.feed(text)
        started = sum(isinstance(e, CallStart) for e in new)
        if started:
            # whitespace before a call is dropped; if the tag turns out to
            # hold no call, it stays (content.text shows it with the tag)
            content.drop_space()
        self.num_calls += started
        events.extend(new)

    @abc.abstractmethod
    def feed(self, text: str) -> list[ToolEvent]:
        """The events the new text decides (possibly none: text held back)."""

    @abc.abstractmethod
    def finish(self) -> list[ToolEvent]:
        """The end of the output: held-back text is decided (an unfinished
        call head becomes content; an unfinished call's arguments end as they are)."""
