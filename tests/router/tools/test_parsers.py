"""The tool-call parsers on whole texts and on the same texts split at every
position (and into single characters): the content, call names and
arguments must not depend on how the text arrives, and nothing that could
still start a call is shown as content before it is decided."""

from __future__ import annotations

import json

import pytest

from router.tools.base import CallArguments, CallStart, ContentText, ToolCallParser
from router.tools.hermes import HermesParser
from router.tools.llama3_json import Llama3JsonParser


def _collect(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from feeding `pieces` then finishing."""
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentText))
    calls: list[list[str]] = []
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(calls)  # calls start in order, once each
            calls.append([event.name, ""])
        elif isinstance(event, CallArguments):
            assert event.index == len(calls) - 1  # only the open call grows
            calls[event.index][1] += event.fragment
    return content, [(name, args) for name, args in calls]


def _splits(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


HERMES_CASES = [
    # (generated text, expected content, expected [(name, arguments object)])
    ("Just text, no call.", "Just text, no call.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Pa}ris\\"{", "n": [1, {"a": []}]}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": 'Pa}ris"{', "n": [1, {"a": []}]}),
                       ("get_time", {})]),
    # keys in another order, arguments as a JSON string: read whole
    ('<tool_call>{"arguments": "{\\"x\\": 1}", "name": "f"}</tool_call> done',
     " done", [("f", {"x": 1})]),
    # a tag without a call stays content, tag and all
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ("x < y and <tool_c", "x < y and <tool_c", []),
    # no closing tag: the output ended
    ('<tool_call>{"name": "f", "arguments": {"k": "v"}}', "", [("f", {"k": "v"})]),
    ("  \n", "  \n", []),
]

LLAMA_CASES = [
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (' \n{"name": "a", "arguments": {"q": "}{"}}; {"name": "b", "parameters": {}}',
     "", [("a", {"q": "}{"}), ("b", {})]),
    ('{"type": "function", "name": "f", "parameters": {"x": [1, 2]}}',
     "", [("f", {"x": [1, 2]})]),
    # JSON that is no call is content
    ('{"answer": 42}', '{"answer": 42}', []),
    ('Use {"name": "f"} like this', 'Use {"name": "f"} like this', []),
    ('{"name": "f", "parameters": {"x": 1}} and then text', "and then text",
     [("f", {"x": 1})]),
    ('{"name": "f", "param', '{"name": "f", "param', []),  # cut short before the call began
]


def _check(parser_type, text, content, calls) -> None:
    for pieces in _splits(text):
        got_content, got_calls = _collect(parser_type(), pieces)
        assert got_content == content, pieces
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, pieces


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_every_split(text, content, calls) -> None:
    _check(HermesParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json_every_split(text, content, calls) -> None:
    _check(Llama3JsonParser, text, content, calls)


def test_arguments_stream_as_written() -> None:
    """A name-first call streams its arguments object exactly as the model
    wrote it, starting as soon as the head is complete."""
    parser = HermesParser()
    assert parser.feed('Hi <tool_call>\n{"name": "f", "argum') == [ContentText("Hi")]
    assert parser.feed('ents": {"a":') == [CallStart(0, "f"), CallArguments(0, '{"a":')]
    assert parser.feed(' 1}}\n</tool_') == [CallArguments(0, " 1}")]
    assert parser.feed("call>") == []
    assert parser.finish() == []


def test_possible_tag_is_held_back() -> None:
    parser = HermesParser()
    assert parser.feed("Hello <tool") == [ContentText("Hello")]
    assert parser.feed("box> x") == [ContentText(" <toolbox> x")]


def test_max_calls_drops_later_calls() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert _collect(HermesParser(max_calls=1), [text]) == ("", [("a", "{}")])
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'
    assert _collect(Llama3JsonParser(max_calls=1), [text]) == ("", [("a", "{}")])
