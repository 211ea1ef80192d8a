"""`tools`, `tool_choice`, `parallel_tool_calls`, tool messages and `documents`:
accepted as OpenAI documents them, or a 400 naming the field; `check_served`
refuses what the served model cannot do."""

from __future__ import annotations

import pytest

from router.api_error import ApiError
from router.generation import ChatMessage
from router.http.requests import parse_chat
from router.tools.request import ToolRequest, check_served

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _chat(**fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_tools_parsed() -> None:
    parsed = parse_chat(_chat(tools=[WEATHER]))
    assert parsed.tools == ToolRequest(tools=(WEATHER,), choice="auto")
    assert parse_chat(_chat()).tools is None
    named = parse_chat(_chat(tools=[WEATHER], parallel_tool_calls=False, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})).tools
    assert (named.choice, named.function_name, named.parallel_tool_calls) == (
        "function", "get_weather", False)
    none = parse_chat(_chat(tools=[WEATHER], tool_choice="none")).tools
    assert not none.parses_calls and none.template_tools() is None
    assert parse_chat(_chat(tool_choice="none")).tools is None


def test_tool_messages_reach_the_template_as_hf_expects() -> None:
    parsed = parse_chat({"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"},
    ]})
    user, assistant, tool = parsed.messages
    assert user == ChatMessage("user", "weather?")
    assert assistant.to_template() == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tool.to_template() == {"role": "tool", "content": "sunny", "tool_call_id": "call_1",
                                  "name": "get_weather"}


BAD = [
    (dict(tools=[]), "tools", "'tools' must be a non-empty list"),
    (dict(tools=[{"type": "code"}]), "tools[0]", "must be an object with \"type\": \"function\""),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]),
     "tools[0].function.name", "must be 1 to 64 letters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools[0].function.parameters", "must be a JSON Schema object"),
    (dict(tools=[WEATHER, WEATHER]), "tools", "names function 'get_weather' twice"),
    (dict(tools=[WEATHER] * 129), "tools", "at most 128 tools, got 129"),
    (dict(tools=[WEATHER], tool_choice="always"), "tool_choice", "must be one of none, auto"),
    (dict(tool_choice="auto"), "tool_choice", "'tool_choice' 'auto' requires 'tools'"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice", "names function 'g', which is not in 'tools'"),
    (dict(tools=[WEATHER], tool_choice={"function": {"name": "get_weather"}}),
     "tool_choice", "must be a string or"),
    (dict(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls", "a boolean"),
    (dict(documents={"a": 1}), "documents", "'documents' must be a list of objects"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id",
     "is required on a tool message"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
     "messages[0].tool_calls", "on an assistant message"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages[0].tool_calls[0].function.arguments", "is not valid JSON"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]),
     "messages[0].tool_calls[0].function.arguments", "must encode a JSON object"),
]


@pytest.mark.parametrize("fields, param, message", BAD)
def test_bad_tool_fields(fields, param, message) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat(_chat(**fields))
    assert info.value.status == 400
    assert info.value.param == param
    assert message in info.value.message


@pytest.mark.parametrize("tools, documents, variables, parser, param, message", [
    (ToolRequest((WEATHER,)), None, {"messages"}, "hermes", "tools",
     "chat template does not read tools"),
    (ToolRequest((WEATHER,)), None, {"messages", "tools"}, None, "tools",
     "--tool-call-parser"),
    (ToolRequest((WEATHER,), choice="required"), None, {"messages"}, "hermes", "tools",
     "chat template does not read tools"),
    (None, ({"title": "t"},), {"messages"}, None, "documents",
     "chat template does not read documents"),
])
def test_check_served_refuses(tools, documents, variables, parser, param, message) -> None:
    with pytest.raises(ApiError) as info:
        check_served(tools, documents, variables, parser)
    assert (info.value.status, info.value.param) == (400, param)
    assert message in info.value.message


def test_check_served_accepts() -> None:
    check_served(ToolRequest((WEATHER,)), None, {"tools"}, "llama3_json")
    # forced calls: a grammar enforces them (router.tools.forced)
    check_served(ToolRequest((WEATHER,), choice="required"), None, {"tools"}, "hermes")
    check_served(ToolRequest((WEATHER,), choice="function", function_name="get_weather"), None,
                 {"tools"}, "llama3_json")
    # tool_choice "none": the tools are not rendered, nothing is parsed
    check_served(ToolRequest((WEATHER,), choice="none"), None, {"messages"}, None)
    check_served(None, ({"title": "t", "text": "x"},), {"documents"}, None)
