"""Forced tool calls: the grammar built per parser format, run through the
real llguidance matcher over the tiny model's tokenizer (what the pods
apply), and the request checks around it."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec, build_tokenizer
from engine.tokenizer import Tokenizer
from router.api_error import ApiError
from router.sampling import SamplingSpec
from router.structured_output import GrammarCheck
from router.tools.base import CallArguments, CallStart
from router.tools.forced import call_grammar, with_call_grammar
from router.tools.request import ToolRequest
from router.tools.select import make_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters
REFS = {"type": "function", "function": {
    "name": "move",
    "parameters": {"type": "object", "properties": {"to": {"$ref": "#/$defs/point"}},
                   "required": ["to"], "additionalProperties": False,
                   "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                       "required": ["x"], "additionalProperties": False}}}}}
REQUIRED = ToolRequest((WEATHER, CLOCK, REFS), choice="required")
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(lambda: build_tokenizer(tokenizer.to_json(), tokenizer.vocab_size,
                                                   tokenizer.eos_token_ids))


def _accepts(compiler, tokenizer, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar allows exactly `text` and then lets the model stop."""
    matcher = compiler.matcher(spec)
    return (matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
            and not matcher.is_error() and matcher.is_accepting())


def _calls(parser: str, text: str) -> list[tuple[str, dict]]:
    """(name, arguments) of the calls `parser` reads in `text`."""
    reader = make_parser(parser)
    events = [*reader.feed(text), *reader.finish()]
    names = [e.name for e in events if isinstance(e, CallStart)]
    arguments: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallArguments):
            arguments[e.index] = arguments.get(e.index, "") + e.fragment
    return [(name, json.loads(arguments[i])) for i, name in enumerate(names)]


def test_hermes_grammar_accepts_tagged_calls_of_the_tools(compiler, tokenizer) -> None:
    spec = call_grammar(REQUIRED, "hermes")
    assert spec.kind is GrammarKind.GRAMMAR
    two = (HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
           '\n<tool_call>\n{"name": "move", "arguments": {"to": {"x": 3}}}\n</tool_call>')
    for text in (HERMES_CALL, two):
        assert _accepts(compiler, tokenizer, spec, text)
    assert _calls("hermes", two) == [("get_weather", {"city": "Paris"}), ("get_time", {}),
                                     ("move", {"to": {"x": 3}})]
    for text in ("Sure." + HERMES_CALL,  # text before the call
                 HERMES_CALL + " done",  # text after it
                 HERMES_CALL.replace("Paris", "Rome"),  # arguments outside the schema
                 HERMES_CALL.replace("get_weather", "get_wind"),  # not a tool
                 '<tool_call>\n{"name": "get_time", "arguments": {"x": 1}}\n</tool_call>',
                 '<tool_call>\n{"name": "move", "arguments": {"to": {"x": "a"}}}\n</tool_call>',
                 HERMES_CALL.replace('", "', '","'),  # not the templates' JSON style
                 HERMES_CALL.replace("<tool_call>", "<tool_call> ")):
        assert not _accepts(compiler, tokenizer, spec, text), text


def test_parallel_tool_calls_false_allows_one_call(compiler, tokenizer) -> None:
    for parser, call in (("hermes", HERMES_CALL), ("llama3_json", LLAMA_CALL)):
        single = ToolRequest((WEATHER, CLOCK), choice="required", parallel_tool_calls=False)
        spec = call_grammar(single, parser)
        assert _accepts(compiler, tokenizer, spec, call)
        separator = "\n" if parser == "hermes" else "; "
        assert not _accepts(compiler, tokenizer, spec, call + separator + call)
        assert _accepts(compiler, tokenizer, call_grammar(REQUIRED, parser),
                        call + separator + call)


def test_named_function_allows_only_that_function(compiler, tokenizer) -> None:
    named = ToolRequest((WEATHER, CLOCK), choice="function", function_name="get_time")
    for parser, call in (("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                                    '</tool_call>'),
                         ("llama3_json", '{"name": "get_time", "parameters": {}}')):
        spec = call_grammar(named, parser)
        assert _accepts(compiler, tokenizer, spec, call)
        assert _calls(parser, call) == [("get_time", {})]
        other = HERMES_CALL if parser == "hermes" else LLAMA_CALL
        assert not _accepts(compiler, tokenizer, spec, other)


def test_llama3_json_grammar_is_the_bare_object(compiler, tokenizer) -> None:
    spec = call_grammar(REQUIRED, "llama3_json")
    assert _accepts(compiler, tokenizer, spec, LLAMA_CALL)
    assert _calls("llama3_json", LLAMA_CALL) == [("get_weather", {"city": "Oslo"})]
    for text in (LLAMA_CALL.replace("parameters", "arguments"), HERMES_CALL,
                 "<|python_tag|>" + LLAMA_CALL, " " + LLAMA_CALL):
        assert not _accepts(compiler, tokenizer, spec, text), text


def test_with_call_grammar_sets_the_grammar_only_for_forced_calls() -> None:
    sampling = SamplingSpec()
    assert with_call_grammar(sampling, None, "hermes") is sampling
    assert with_call_grammar(sampling, ToolRequest((WEATHER,)), "hermes") is sampling
    assert with_call_grammar(sampling, REQUIRED, None) is sampling  # check_served refuses it
    assert with_call_grammar(sampling, REQUIRED, "hermes").grammar == call_grammar(REQUIRED,
                                                                                   "hermes")
    with pytest.raises(ValueError, match="does not force a call"):
        call_grammar(ToolRequest((WEATHER,)), "hermes")


@pytest.mark.parametrize("grammar, field", [
    (GrammarSpec.json_schema({"type": "object"}), "response_format"),
    (GrammarSpec(GrammarKind.REGEX, "a+"), "guided_regex"),
    (GrammarSpec(GrammarKind.GRAMMAR, 'start: "x"'), "guided_grammar"),
])
def test_a_grammar_of_the_request_with_a_forced_call_is_refused(grammar, field) -> None:
    named = ToolRequest((WEATHER,), choice="function", function_name="get_weather")
    for tools, forced in ((REQUIRED, "'required'"), (named, "a named function")):
        with pytest.raises(ApiError) as info:
            with_call_grammar(SamplingSpec(grammar=grammar), tools, "hermes")
        assert (info.value.status, info.value.param) == (400, field)
        assert f"'{field}' cannot be combined with 'tool_choice' {forced}" in info.value.message


def test_the_refusal_names_the_field_the_grammar_came_from() -> None:
    choice = SamplingSpec(grammar=GrammarSpec(GrammarKind.REGEX, "yes|no"))
    with pytest.raises(ApiError) as info:
        with_call_grammar(choice, REQUIRED, "hermes", grammar_field="guided_choice")
    assert (info.value.status, info.value.param) == (400, "guided_choice")
    assert info.value.message.startswith("'guided_choice' cannot be combined with 'tool_choice'")


def test_uncompilable_parameters_are_a_400_naming_tools(tokenizer) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    spec = with_call_grammar(SamplingSpec(), ToolRequest((bad,), choice="required"),
                             "hermes").grammar

    async def run_blocking(fn, *args):
        return fn(*args)

    with pytest.raises(ApiError) as info:
        asyncio.run(GrammarCheck(tokenizer).check(spec, run_blocking, field="tools"))
    assert (info.value.status, info.value.param) == (400, "tools")
