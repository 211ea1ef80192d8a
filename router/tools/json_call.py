"""`CallScanner`: one JSON tool call, `{"name": "f", "arguments": {...}}`
(or `"parameters"`, Llama 3's word), read incrementally.

Both formats (router.tools.llama3_json, router.tools.hermes) write a call as
this JSON object. The scanner streams it the way OpenAI does: once the head
`{"name": "<name>", "arguments": {` has arrived it emits `CallStart(name)`,
then the arguments object's text as it arrives (`CallArguments` fragments,
concatenating to the object exactly as the model wrote it), and it ends at
the call object's closing brace. A call written another way (keys in
another order, arguments as a JSON-encoded string, extra keys first) is
read whole once its closing brace arrives and emitted at once, its
arguments re-serialized with `json.dumps`; text that is not a call at all
is reported `failed`, and the owner shows it as content.

Nesting is tracked with string and escape awareness, so braces inside
string values never end the call early.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from router.tools.base import WHITESPACE, CallArguments, CallStart, ToolEvent

_NAME_KEYS = ('"name"',)
_ARGUMENT_KEYS = ('"arguments"', '"parameters"')


class _Depth:
    """A JSON text's nesting depth across pieces, strings and escapes understood."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self._in_string = False
        self._escape = False

    def scan(self, text: str) -> int | None:
        """The index just past the character that brings the depth back to 0,
        or None when the text ends first."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class _Head(enum.Enum):
    PARTIAL = "partial"  # a prefix of a head: wait for more text
    MATCH = "match"
    FAIL = "fail"  # not a name-first head: read the object whole


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def _literal(text: str, pos: int, choices: tuple[str, ...]) -> tuple[_Head, int]:
    rest = text[pos:]
    for choice in choices:
        if rest.startswith(choice):
            return _Head.MATCH, pos + len(choice)
    if any(choice.startswith(rest) for choice in choices):
        return _Head.PARTIAL, pos
    return _Head.FAIL, pos


def _string(text: str, pos: int) -> tuple[_Head, int, str]:
    if pos == len(text):
        return _Head.PARTIAL, pos, ""
    if text[pos] != '"':
        return _Head.FAIL, pos, ""
    escape = False
    for end in range(pos + 1, len(text)):
        if escape:
            escape = False
        elif text[end] == "\\":
            escape = True
        elif text[end] == '"':
            try:
                return _Head.MATCH, end + 1, json.loads(text[pos:end + 1])
            except json.JSONDecodeError:
                return _Head.FAIL, pos, ""
    return _Head.PARTIAL, pos, ""


def match_head(text: str) -> tuple[_Head, str, int]:
    """Match `{"name": "<name>", "arguments": ` (whitespace anywhere JSON
    allows it) at the start of `text`. Returns (state, name, index of the
    arguments object's `{`)."""
    pos = 0
    name = ""
    steps: tuple[tuple[str, ...] | None, ...] = (
        ("{",), _NAME_KEYS, (":",), None, (",",), _ARGUMENT_KEYS, (":",), ("{",))
    for i, step in enumerate(steps):
        pos = _skip_space(text, pos)
        if pos == len(text):
            return _Head.PARTIAL, "", pos
        if step is None:
            state, pos, name = _string(text, pos)
            if state is _Head.MATCH and not name:
                state = _Head.FAIL  # an empty name is no call (call_from_object agrees)
        elif i == len(steps) - 1:
            # the arguments object: its brace is the first character of the arguments
            return (_Head.MATCH, name, pos) if text[pos] == "{" else (_Head.FAIL, "", pos)
        else:
            state, pos = _literal(text, pos, step)
        if state is not _Head.MATCH:
            return state, "", pos
    raise AssertionError("unreachable: the last step returns")


def call_from_object(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a parsed call object, or None when it is
    not one. Missing arguments are `{}`; arguments given as a JSON-encoded
    string are accepted when the string holds a JSON object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class _State(enum.Enum):
    HEAD = "head"  # undecided: waiting for the head
    ARGUMENTS = "arguments"  # streaming the arguments object
    TAIL = "tail"  # after the arguments, up to the call's closing brace
    WHOLE = "whole"  # not name-first: collecting the object to parse it whole
    DONE = "done"
    FAILED = "failed"


class CallScanner:
    """Reads one call object fed from its opening `{` (leading whitespace
    allowed). After `feed`: `done` (the call ended; `rest` is the text after
    it) or `failed` (not a call; `raw` is the text read, `rest` what follows)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.started = False  # CallStart emitted
        self.raw = ""  # text consumed while undecided
        self.rest = ""
        self._state = _State.HEAD
        self._depth = _Depth()

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def failed(self) -> bool:
        return self._state is _State.FAILED

    def pending_text(self) -> str:
        """Text held while undecided (shown as content if the output ends here)."""
        return "" if self.started else self.raw

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._state is _State.HEAD:
            self.raw += text
            state, name, args_at = match_head(self.raw)
            if state is _Head.PARTIAL:
                return events
            if state is _Head.MATCH:
                self.started = True
                events.append(CallStart(self.index, name))
                self._state = _State.ARGUMENTS
                text = self.raw[args_at:]
            else:
                self._state = _State.WHOLE
                text, self.raw = self.raw, ""
        if self._state is _State.ARGUMENTS:
            end = self._depth.scan(text)
            fragment = text if end is None else text[:end]
            if fragment:
                events.append(CallArguments(self.index, fragment))
            if end is None:
                return events
            self._state = _State.TAIL
            self._depth = _Depth(depth=1)  # the call object is still open
            text = text[end:]
        if self._state is _State.TAIL:
            end = self._depth.scan(text)
            if end is not None:
                self._state = _State.DONE
                self.rest = text[end:]
            return events
        if self._state is _State.WHOLE:
            self._read_whole(text, events)
        return events

    def _read_whole(self, text: str, events: list[ToolEvent]) -> None:
        if self._depth.depth == 0 and not self.raw.strip(WHITESPACE):
            # still before the object: it must open with a brace
            start = _skip_space(text, 0)
            if start < len(text) and text[start] != "{":
                self.raw += text[:start]
                self._state, self.rest = _State.FAILED, text[start:]
                return
        end = self._depth.scan(text)
        if end is None:
            self.raw += text
            return
        self.raw += text[:end]
        self.rest = text[end:]
        try:
            call = call_from_object(json.loads(self.raw))
        except json.JSONDecodeError:
            call = None
        if call is None:
            self._state = _State.FAILED
            return
        self.started = True
        self._state = _State.DONE
        events.append(CallStart(self.index, call[0]))
        events.append(CallArguments(self.index, call[1]))
