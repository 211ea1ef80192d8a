"""Structured outputs at the router: the API's grammar fields -> one
`GrammarSpec`, and the check that refuses a bad one with a 400.

    response_format {"type": "text"}          no grammar (the default)
    response_format {"type": "json_object"}   any JSON object
    response_format {"type": "json_schema",   a JSON document valid under the
      "json_schema": {"name", "schema", ...}}   schema (OpenAI's shape)
    guided_regex "..."                        vLLM's extension: the regex's language
    guided_grammar "..."                      vLLM's extension: a Lark or GBNF grammar

At most one of them may constrain a request. `grammar_from_body` (called
by router.http.requests while it reads the body, on the event loop) checks
the JSON shape; `GrammarCheck.check` (called by `Frontend.prepare`)
compiles the spec on the frontend's threads with the same compiler and
limits the pods use (engine.grammar, over the router's copy of the model's
tokenizer), so a schema llguidance cannot compile is refused here with a
400 naming the field and llguidance's reason, and the pods compile what the
router accepted. Compiled specs are cached, so a repeated schema costs a
dictionary look-up.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec, build_tokenizer
from engine.tokenizer import Tokenizer
from router.api_error import bad_request

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# The request field each kind of grammar comes from, to name it in errors.
FIELD_OF_KIND = {GrammarKind.JSON_SCHEMA: "response_format",
                 GrammarKind.REGEX: "guided_regex", GrammarKind.GRAMMAR: "guided_grammar"}


def grammar_from_body(body: dict[str, Any]) -> GrammarSpec | None:
    """The request's grammar, or None; ApiError 400 naming the field that is malformed."""
    specs: list[GrammarSpec] = []
    response_format = body.get("response_format")
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            specs.append(spec)
    for kind in (GrammarKind.REGEX, GrammarKind.GRAMMAR):
        name = FIELD_OF_KIND[kind]
        text = body.get(name)
        if text is None:
            continue
        if not isinstance(text, str) or not text:
            raise bad_request(f"'{name}' must be a non-empty string", name)
        specs.append(_spec(kind, text, name))
    if len(specs) > 1:
        raise bad_request("only one of 'response_format' (json_object or json_schema), "
                          "'guided_regex' and 'guided_grammar' may be set",
                          FIELD_OF_KIND[specs[1].kind])
    return specs[0] if specs else None


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


def _spec(kind: GrammarKind, value: Any, name: str) -> GrammarSpec:
    try:
        if kind is GrammarKind.JSON_SCHEMA:
            return GrammarSpec.json_schema(value)
        return GrammarSpec(kind, value)
    except ValueError as exc:  # over the size limit
        raise bad_request(f"'{name}': {exc}", name) from None


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
