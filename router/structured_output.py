"""Structured outputs at the router: the API's grammar fields -> one
`GrammarSpec`, and the check that refuses a bad one with a 400.

    response_format {"type": "text"}          no grammar (the default)
    response_format {"type": "json_object"}   any JSON object
    response_format {"type": "json_schema",   a JSON document valid under the
      "json_schema": {"name", "schema", ...}}   schema (OpenAI's shape)
    guided_json {...} or "{...}"              vLLM's extension: the same, the schema
                                              itself (an object or its JSON text)
    guided_choice ["a", "b", ...]             vLLM's extension: exactly one of the
                                              strings (a regex of their literals)
    guided_regex "..."                        vLLM's extension: the regex's language
    guided_grammar "..."                      vLLM's extension: a Lark or GBNF grammar

At most one of them may constrain a request. `grammar_from_body` (called
by router.http.requests while it reads the body, on the event loop) checks
the JSON shape and returns the spec with the field it came from
(`RequestGrammar`), so that every later 400 names the field the client
sent; `GrammarCheck.check` (called by `Frontend.prepare`) compiles the spec
on the frontend's threads with the same compiler and limits the pods use
(engine.grammar, over the router's copy of the model's tokenizer), so a
schema llguidance cannot compile is refused here with a 400 naming the
field and llguidance's reason, and the pods compile what the router
accepted. Compiled specs are cached, so a repeated schema costs a
dictionary look-up.

The wire (`SamplingParams.grammar`) knows three kinds only: guided_json
travels as a json_schema, guided_choice as a regex.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec, build_tokenizer
from engine.tokenizer import Tokenizer
from router.api_error import bad_request

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# The request field a spec of each kind is named by when the request does
# not say (the gRPC front door, whose Grammar message has one field per kind).
FIELD_OF_KIND = {GrammarKind.JSON_SCHEMA: "response_format",
                 GrammarKind.REGEX: "guided_regex", GrammarKind.GRAMMAR: "guided_grammar"}
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_choice", "guided_regex",
                  "guided_grammar")


@dataclass(frozen=True, slots=True)
class RequestGrammar:
    """A request's grammar and the body field it came from (what a 400 names)."""

    spec: GrammarSpec
    field: str

    def __post_init__(self) -> None:
        if self.field not in GRAMMAR_FIELDS:
            raise ValueError(f"field must be one of {GRAMMAR_FIELDS}, got {self.field!r}")


def grammar_from_body(body: dict[str, Any]) -> RequestGrammar | None:
    """The request's grammar, or None; ApiError 400 naming the field that is malformed."""
    found: list[RequestGrammar] = []
    for name in GRAMMAR_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        spec = _READERS[name](value)
        if spec is not None:  # response_format {"type": "text"} constrains nothing
            found.append(RequestGrammar(spec, name))
    if len(found) > 1:
        raise bad_request("only one of 'response_format' (json_object or json_schema), "
                          "'guided_json', 'guided_choice', 'guided_regex' and "
                          "'guided_grammar' may be set", found[1].field)
    return found[0] if found else None


def _response_format(value: Any) -> GrammarSpec | None:
    name = "response_format"
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object with a 'type'", name)
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"'{name}.type' must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
                          f"got {kind!r}", f"{name}.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec(GrammarKind.JSON_SCHEMA, {"type": "object"}, name)
    json_schema = value.get("json_schema")
    if not isinstance(json_schema, dict):
        raise bad_request(f"'{name}.json_schema' must be an object with a 'schema' "
                          "(response_format type json_schema)", f"{name}.json_schema")
    schema = json_schema.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"'{name}.json_schema.schema' must be a JSON schema object, got "
                          f"{type(schema).__name__}", f"{name}.json_schema.schema")
    label = json_schema.get("name")
    if label is not None and not isinstance(label, str):
        raise bad_request(f"'{name}.json_schema.name' must be a string",
                          f"{name}.json_schema.name")
    return _spec(GrammarKind.JSON_SCHEMA, schema, name)


def _guided_json(value: Any) -> GrammarSpec:
    """vLLM takes the schema as an object or as its JSON text."""
    name = "guided_json"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # JSONDecodeError, or nested past the stack
            raise bad_request(f"'{name}' is a string that is not a JSON document: send the "
                              "schema as an object or as its JSON text", name) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be a JSON schema object, got {type(value).__name__}",
                          name)
    return _spec(GrammarKind.JSON_SCHEMA, value, name)


def _guided_choice(value: Any) -> GrammarSpec:
    name = "guided_choice"
    if not (isinstance(value, list) and value
            and all(isinstance(choice, str) and choice for choice in value)):
        raise bad_request(f"'{name}' must be a non-empty list of non-empty strings", name)
    return _spec(GrammarKind.REGEX, choice_regex(value), name)


def choice_regex(choices: list[str]) -> str:
    """A regex whose language is exactly `choices`: every character but an
    ASCII letter or digit written as `\\x{hex}` (llguidance reads Rust regex
    syntax, which takes that escape for any code point), so no choice can
    be read as regex syntax."""
    return "|".join("".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}"
                            for c in choice)
                    for choice in choices)


def _guided_text(name: str) -> Callable[[Any], GrammarSpec]:
    kind = GrammarKind.REGEX if name == "guided_regex" else GrammarKind.GRAMMAR

    def read(value: Any) -> GrammarSpec:
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{name}' must be a non-empty string", name)
        return _spec(kind, value, name)
    return read


def _spec(kind: GrammarKind, value: Any, name: str) -> GrammarSpec:
    try:
        if kind is GrammarKind.JSON_SCHEMA:
            return GrammarSpec.json_schema(value)
        return GrammarSpec(kind, value)
    except ValueError as exc:  # over the size limit
        raise bad_request(f"'{name}': {exc}", name) from None


_READERS: dict[str, Callable[[Any], GrammarSpec | None]] = {
    "response_format": _response_format, "guided_json": _guided_json,
    "guided_choice": _guided_choice, "guided_regex": _guided_text("guided_regex"),
    "guided_grammar": _guided_text("guided_grammar"),
}


RunBlocking = Callable[..., Awaitable[Any]]


class GrammarCheck:
    """Compiles request grammars for the router (see module doc). One per
    router; `check` runs on the event loop, the compile on `run_blocking`'s
    threads."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._compiler = GrammarCompiler(lambda: build_tokenizer(
            tokenizer.to_json(), tokenizer.vocab_size, tokenizer.eos_token_ids))

    async def check(self, spec: GrammarSpec | None, run_blocking: RunBlocking,
                    field: str | None = None) -> None:
        """ApiError 400 naming the field (`field`, else the kind's) when
        `spec` does not compile."""
        if spec is None:
            return
        try:
            await run_blocking(self._compiler.compile, spec)
        except ValueError as exc:
            name = field or FIELD_OF_KIND[spec.kind]
            raise bad_request(f"'{name}' cannot be used for structured output: {exc}",
                              name) from None
