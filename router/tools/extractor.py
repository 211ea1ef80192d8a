"""`ToolCallExtractor`: a chat request's deltas with tool calls taken out.

The HTTP handler (router.http.server) wraps the flow's deltas in
`ToolCallDeltas` when the request has tools (tool_choice other than
"none"): each delta's text goes through the request's `ToolCallParser`;
what is plain text stays `Delta.text`, calls become `Delta.tool_calls`
entries (`ToolCallDelta`: id, name and the first arguments in a call's
first entry, more arguments after), and a reply that called tools and
stopped finishes with "tool_calls" instead of "stop" ("length" stays:
the call may be cut short). One delta in, one delta out, so logprobs and
usage pass through unchanged. Per request, on the event loop.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from router.generation import Delta, ToolCallDelta
from router.tools.base import CallArguments, CallStart, ContentText, ToolCallParser, ToolEvent


def new_call_id() -> str:
    """An id like OpenAI's (`call_` and 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallExtractor:
    """Turns one request's deltas into content + tool-call deltas."""

    def __init__(self, parser: ToolCallParser,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._parser = parser
        self._new_id = new_id

    def convert(self, delta: Delta) -> Delta:
        events = self._parser.feed(delta.text)
        if delta.finish_reason is not None:
            events += self._parser.finish()
        text, calls = self._merge(events)
        finish = delta.finish_reason
        if finish == "stop" and self._parser.num_calls:
            finish = "tool_calls"
        return Delta(text=text, token_ids=delta.token_ids, logprobs=delta.logprobs,
                     finish_reason=finish, usage=delta.usage, tool_calls=calls)

    def _merge(self, events: list[ToolEvent]) -> tuple[str, tuple[ToolCallDelta, ...]]:
        """Content text, and one ToolCallDelta per call the events touch."""
        text: list[str] = []
        calls: dict[int, ToolCallDelta] = {}
        for event in events:
            if isinstance(event, ContentText):
                text.append(event.text)
            elif isinstance(event, CallStart):
                calls[event.index] = ToolCallDelta(event.index, id=self._new_id(),
                                                   name=event.name)
            elif isinstance(event, CallArguments):
                old = calls.get(event.index, ToolCallDelta(event.index))
                calls[event.index] = ToolCallDelta(old.index, old.arguments + event.fragment,
                                                   old.id, old.name)
        return "".join(text), tuple(calls.values())


class ToolCallDeltas:
    """`deltas` (a flow's) converted by `extractor`; errors pass through."""

    def __init__(self, deltas: AsyncIterator[Delta], extractor: ToolCallExtractor) -> None:
        self._deltas = deltas
        self._extractor = extractor

    def __aiter__(self) -> ToolCallDeltas:
        return self

    async def __anext__(self) -> Delta:
        return self._extractor.convert(await anext(self._deltas))
