"""The router's structured-output fields: response_format / guided_regex /
guided_grammar -> GrammarSpec, a 400 naming the field for every malformed
or uncompilable one, and the spec's wire form."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.grammar import MAX_GRAMMAR_CHARS, GrammarKind, GrammarSpec
from engine.tokenizer import Tokenizer
from router.api_error import ApiError
from router.http.requests import parse_chat, parse_completion
from router.sampling import SamplingSpec, sampling_from_proto, sampling_to_proto
from router.structured_output import GrammarCheck

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_response_format_kinds_on_both_endpoints():
    json_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                          "strict": True}}
    assert parse_chat(_chat(response_format=json_schema)).sampling.grammar == (
        GrammarSpec.json_schema(SCHEMA))
    assert parse_chat(_chat(response_format={"type": "json_object"})).sampling.grammar == (
        GrammarSpec.json_schema({"type": "object"}))
    assert parse_chat(_chat(response_format={"type": "text"})).sampling.grammar is None
    assert parse_chat(_chat()).sampling.grammar is None
    completion = parse_completion({"model": "tiny", "prompt": "p", "guided_regex": "a+"})
    assert completion.sampling.grammar == GrammarSpec(GrammarKind.REGEX, "a+")
    lark = parse_completion({"model": "tiny", "prompt": "p", "guided_grammar": 'start: "x"'})
    assert lark.sampling.grammar == GrammarSpec(GrammarKind.GRAMMAR, 'start: "x"')


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"response_format": "json"}, "response_format", "must be an object with a 'type'"),
    ({"response_format": {"type": "yaml"}}, "response_format.type",
     "must be one of text, json_object, json_schema, got 'yaml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "must be an object with a 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "must be a JSON schema object, got NoneType"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "response_format.json_schema.name", "must be a string"),
    ({"guided_regex": ""}, "guided_regex", "must be a non-empty string"),
    ({"guided_grammar": 5}, "guided_grammar", "must be a non-empty string"),
    ({"guided_regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "guided_regex",
     f"the limit is {MAX_GRAMMAR_CHARS}"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "only one of 'response_format'"),
])
def test_malformed_fields_are_refused(fields, param, fragment):
    with pytest.raises(ApiError) as info:
        parse_chat(_chat(**fields))
    assert (info.value.status, info.value.param) == (400, param)
    assert fragment in info.value.message


@pytest.fixture(scope="module")
def check(tiny_model_dir) -> GrammarCheck:
    return GrammarCheck(Tokenizer.from_pretrained(tiny_model_dir))


async def _inline(fn, *args):
    return fn(*args)


@pytest.mark.parametrize(("spec", "param", "fragment"), [
    (GrammarSpec.json_schema({"type": "objectx"}), "response_format", "Invalid type: objectx"),
    (GrammarSpec.json_schema({"type": "string", "pattern": "(("}), "response_format",
     "unclosed group"),
    (GrammarSpec(GrammarKind.REGEX, "[z-a]"), "guided_regex", "invalid regex"),
    (GrammarSpec(GrammarKind.GRAMMAR, "start: nothing"), "guided_grammar", "unknown name"),
])
def test_uncompilable_grammar_is_a_400_naming_the_field(check, spec, param, fragment):
    with pytest.raises(ApiError) as info:
        asyncio.run(check.check(spec, _inline))
    assert (info.value.status, info.value.param) == (400, param)
    assert "cannot be used for structured output" in info.value.message
    assert fragment in info.value.message


def test_valid_grammar_passes(check):
    asyncio.run(check.check(GrammarSpec.json_schema(SCHEMA), _inline))
    asyncio.run(check.check(None, _inline))


@pytest.mark.parametrize("grammar", [
    None, GrammarSpec.json_schema(SCHEMA), GrammarSpec(GrammarKind.REGEX, "a|b"),
    GrammarSpec(GrammarKind.GRAMMAR, 'start: "x"'),
])
def test_grammar_round_trips_the_wire(grammar):
    spec = SamplingSpec(max_tokens=4, grammar=grammar)
    message = sampling_to_proto(spec)
    assert sampling_from_proto(message).grammar == grammar
    if grammar is not None:
        assert message.grammar.WhichOneof("spec") == grammar.kind.value
    if grammar is not None and grammar.kind is GrammarKind.JSON_SCHEMA:
        assert json.loads(message.grammar.json_schema) == SCHEMA
