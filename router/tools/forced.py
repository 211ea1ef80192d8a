"""Forced tool calls: `tool_choice` "required" or a named function, enforced
by a grammar on the model's output.

The grammar is the selected parser's call format, as a Lark grammar with
each call's JSON embedded through llguidance's `%json {schema}`:

    hermes        <tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>
                  one or more, "\\n" between (one when parallel_tool_calls is false)
    llama3_json   {"name": N, "parameters": A}
                  one or more, "; " between (one when parallel_tool_calls is false)

N is one of the tools' names ("required") or the named one; A is valid
under that tool's `parameters` schema (a tool without one takes no
arguments: `{}`; the schema's `$defs`/`definitions` move to the embedded
document's root, where its "#/$defs/..." references point). Each tool is
its own alternative, so a name fixes the schema its arguments follow. The
JSON is written with ", " and ": " (how the chat templates show calls to
the model, `tojson`) and no other whitespace, so it cannot pad forever. The grammar then ends: the
model can only stop. The output parses through the same parser as an
unforced reply.

The spec is an ordinary `GrammarSpec` (kind "grammar") in the request's
`SamplingSpec.grammar`, the path response_format takes, so it is compiled
and refused (400) by the router's `GrammarCheck`, and reaches colocated,
prefill and decode pods alike. A request that also sets a grammar of its
own (response_format json, guided_json/choice/regex/grammar) is refused with a
400 naming that field: its output could not be both.
"""

from __future__ import annotations

import json
from dataclasses import replace

from engine.grammar import GrammarKind, GrammarSpec
from router.api_error import bad_request
from router.sampling import SamplingSpec
from router.structured_output import FIELD_OF_KIND
from router.tools.hermes import CLOSE_TAG, OPEN_TAG
from router.tools.llama3_json import Llama3JsonParser
from router.tools.request import ToolRequest

# A tool declared without `parameters` takes none (OpenAI's reading).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_DEFINITIONS = ("$defs", "definitions")
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def forces_call(tools: ToolRequest | None) -> bool:
    return tools is not None and tools.choice in ("required", "function")


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lark string literal


def call_grammar(tools: ToolRequest, parser: str) -> GrammarSpec:
    """The grammar of a forced reply in `parser`'s format (see module doc)."""
    if not forces_call(tools):
        raise ValueError(f"tool_choice {tools.choice!r} does not force a call")
    arguments_key = "parameters" if parser == Llama3JsonParser.name else "arguments"
    chosen = [t["function"] for t in tools.tools
              if tools.choice == "required" or t["function"]["name"] == tools.function_name]
    rules = []
    for i, function in enumerate(chosen):
        parameters = dict(function.get("parameters") or NO_PARAMETERS)
        # "#/$defs/..." references resolve against the embedded document's root
        hoisted = {key: parameters.pop(key) for key in _DEFINITIONS if key in parameters}
        schema = {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key],
            "additionalProperties": False,
            "x-guidance": _JSON_STYLE,
            **hoisted,
        }
        rules.append(f"tool_{i}: %json {json.dumps(schema)}")  # keys in order: "name" first
    if parser == Llama3JsonParser.name:
        call, separator = "body", "; "
    else:
        call, separator = "tagged", "\n"
        rules.append(f"tagged: {_lark_string(OPEN_TAG + chr(10))} body "
                     f"{_lark_string(chr(10) + CLOSE_TAG)}")
    start = f"{call} ({_lark_string(separator)} {call})*" if tools.parallel_tool_calls else call
    alternatives = " | ".join(f"tool_{i}" for i in range(len(chosen)))
    lines = [f"start: {start}", f"body: {alternatives}", *rules]
    return GrammarSpec(GrammarKind.GRAMMAR, "\n".join(lines) + "\n")


def with_call_grammar(sampling: SamplingSpec, tools: ToolRequest | None,
                      parser: str | None, *, grammar_field: str | None = None) -> SamplingSpec:
    """`sampling` with the forced-call grammar when `tools` forces a call;
    unchanged otherwise, or when no parser is known (check_served refuses
    the request then). ApiError 400 when the request has a grammar already,
    naming `grammar_field` (the body field it came from) or its kind's field."""
    if not forces_call(tools) or parser is None:
        return sampling
    assert tools is not None
    if sampling.grammar is not None:
        field = grammar_field or FIELD_OF_KIND[sampling.grammar.kind]
        forced = "'required'" if tools.choice == "required" else "a named function"
        raise bad_request(f"'{field}' cannot be combined with 'tool_choice' {forced}: the "
                          "forced tool call is itself a grammar on the output", field)
    try:
        spec = call_grammar(tools, parser)
    except ValueError as exc:  # over the grammar size limit
        raise bad_request(f"'tools' are too large to force a call: {exc}", "tools") from None
    return replace(sampling, grammar=spec)
