"""The router's structured-output fields: response_format / guided_json /
guided_choice / guided_regex / guided_grammar -> GrammarSpec, a 400 naming
the field for every malformed or uncompilable one, guided_choice's regex
through the real llguidance matcher, and the spec's wire form."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.grammar import (
    MAX_GRAMMAR_CHARS,
    GrammarCompiler,
    GrammarKind,
    GrammarSpec,
    build_tokenizer,
)
from engine.tokenizer import Tokenizer
from router.api_error import ApiError
from router.http.requests import parse_chat, parse_completion
from router.sampling import SamplingSpec, sampling_from_proto, sampling_to_proto
from router.structured_output import GrammarCheck, choice_regex

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
    assert (completion.grammar_field, lark.grammar_field) == ("guided_regex", "guided_grammar")
    assert parse_chat(_chat(response_format=json_schema)).grammar_field == "response_format"
    assert parse_chat(_chat()).grammar_field is None


def test_guided_json_is_a_json_schema_given_as_an_object_or_its_text():
    for value in (SCHEMA, json.dumps(SCHEMA, indent=2)):
        for parse, body in ((parse_chat, _chat(guided_json=value)),
                            (parse_completion, {"model": "t", "prompt": "p",
                                                "guided_json": value})):
            parsed = parse(body)
            assert parsed.sampling.grammar == GrammarSpec.json_schema(SCHEMA)
            assert parsed.grammar_field == "guided_json"


def test_guided_choice_is_a_regex_of_the_literals():
    parsed = parse_chat(_chat(guided_choice=["yes", "no way", "a.b|c"]))
    assert parsed.sampling.grammar == GrammarSpec(
        GrammarKind.REGEX, r"yes|no\x{20}way|a\x{2e}b\x{7c}c")
    assert parsed.grammar_field == "guided_choice"


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
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice",
     "only one of 'response_format' (json_object or json_schema), 'guided_json', "
     "'guided_choice', 'guided_regex' and 'guided_grammar' may be set"),
    ({"guided_json": ["a"]}, "guided_json", "'guided_json' must be a JSON schema object, got list"),
    ({"guided_json": "{not json"}, "guided_json",
     "'guided_json' is a string that is not a JSON document: send the schema as an object or "
     "as its JSON text"),
    ({"guided_json": "[1]"}, "guided_json", "must be a JSON schema object, got list"),
    ({"guided_json": "[" * 100_000}, "guided_json", "is a string that is not a JSON document"),
    ({"guided_choice": []}, "guided_choice",
     "'guided_choice' must be a non-empty list of non-empty strings"),
    ({"guided_choice": "yes"}, "guided_choice", "must be a non-empty list of non-empty strings"),
    ({"guided_choice": ["yes", ""]}, "guided_choice", "must be a non-empty list"),
    ({"guided_choice": ["yes", 1]}, "guided_choice", "must be a non-empty list"),
    ({"guided_choice": ["é" * (MAX_GRAMMAR_CHARS // 4)]}, "guided_choice",
     f"the limit is {MAX_GRAMMAR_CHARS}"),
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


# Each choice must come out exactly: regex syntax, JSON quoting, whitespace,
# non-ASCII and a choice that is a prefix of another.
CHOICES = ["yes", "yes!", 'say "hi"', "a|b.c*(d)", "x{2}", "new\nline", "tab\there",
           "back\\slash", "ünïcode ✓", "[set]^$"]


def test_guided_choice_accepts_exactly_the_choices(tiny_model_dir):
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    compiler = GrammarCompiler(lambda: build_tokenizer(tokenizer.to_json(), tokenizer.vocab_size,
                                                       tokenizer.eos_token_ids))
    spec = GrammarSpec(GrammarKind.REGEX, choice_regex(CHOICES))

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(spec)
        return (matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
                and not matcher.is_error() and matcher.is_accepting())

    assert all(accepts(choice) for choice in CHOICES)
    for other in ("ye", "yes!!", "say hi", "abc", "x{22}", "xx", "new line", "back\\\\slash",
                  "unicode", "set", "a|b.c*(d)e"):
        assert not accepts(other), other


def test_uncompilable_guided_json_is_a_400_naming_it(tiny_model_dir):
    frontend_check = GrammarCheck(Tokenizer.from_pretrained(tiny_model_dir))
    parsed = parse_chat(_chat(guided_json={"type": "objectx"}))
    with pytest.raises(ApiError) as info:
        asyncio.run(frontend_check.check(parsed.sampling.grammar, _inline,
                                         field=parsed.grammar_field))
    assert (info.value.status, info.value.param) == (400, "guided_json")
    assert info.value.message.startswith("'guided_json' cannot be used for structured output")
