"""The chat request's tool fields, checked: `tools`, `tool_choice`,
`parallel_tool_calls`, the `tool_calls`/`tool_call_id`/`name` of its
messages, and the `documents` extension (HF templates' RAG variable).

Called by router.http.requests.parse_chat on the event loop; every problem is
an `ApiError` 400 naming the field (`tools[2].function.name`, ...).
`check_served` (called by router.frontend.Frontend.tokenize) refuses what the
served model cannot do: tools its chat template never reads (they would be
silently dropped) and a template with no known call format. (tool_choice
"required" or a named function is enforced by a grammar: router.tools.forced.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from router.api_error import bad_request

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools. `choice` is "none", "auto", "required" or
    "function" (then `function_name` is the forced function)."""

    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"
    function_name: str | None = None
    parallel_tool_calls: bool = True

    def __post_init__(self) -> None:
        if self.choice not in (*TOOL_CHOICES, "function"):
            raise ValueError(f"choice must be one of {TOOL_CHOICES} or 'function', "
                             f"got {self.choice!r}")
        if (self.choice == "function") != (self.function_name is not None):
            raise ValueError("function_name is set exactly when choice is 'function'")

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for tool calls (not with "none")."""
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` the chat template gets: none with tool_choice "none",
        so the model is not invited to call what the reply will not parse."""
        return list(self.tools) if self.parses_calls else None


def _check_tool(tool: Any, where: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"'{where}' must be an object with \"type\": \"function\"", where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"'{where}.function' must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"'{where}.function.name' must be 1 to 64 letters, digits, '_', '-' "
                          f"or '.', got {name!r}", f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{where}.function.description' must be a string",
                          f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"'{where}.function.parameters' must be a JSON Schema object",
                          f"{where}.function.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{where}.function.strict' must be a boolean",
                          f"{where}.function.strict")
    return name


def _tool_choice(raw: Any, names: list[str]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if names else "none"), None
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise bad_request(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                              f"got {raw!r}", "tool_choice")
        if raw != "none" and not names:
            raise bad_request(f"'tool_choice' {raw!r} requires 'tools'", "tool_choice")
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    else:
        name = None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be a string or {\"type\": \"function\", "
                          "\"function\": {\"name\": string}}", "tool_choice")
    if name not in names:
        raise bad_request(f"'tool_choice' names function {name!r}, which is not in 'tools'",
                          "tool_choice")
    return "function", name


def parse_tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` of a chat body; None
    when the request has no tools."""
    raw_tools = body.get("tools")
    if raw_tools is not None and (not isinstance(raw_tools, list) or not raw_tools):
        raise bad_request("'tools' must be a non-empty list of function tools", "tools")
    raw_tools = raw_tools or []
    if len(raw_tools) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} tools, got {len(raw_tools)}",
                          "tools")
    names = [_check_tool(tool, f"tools[{i}]") for i, tool in enumerate(raw_tools)]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"'tools' names function {twice!r} twice", "tools")
    choice, function_name = _tool_choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not raw_tools:
        return None
    return ToolRequest(tools=tuple(raw_tools), choice=choice, function_name=function_name,
                       parallel_tool_calls=parallel is not False)


def parse_documents(body: dict[str, Any]) -> tuple[dict[str, Any], ...] | None:
    """The `documents` extension (vLLM's too): a list of objects the template
    gets as `documents`."""
    documents = body.get("documents")
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
        raise bad_request("'documents' must be a list of objects", "documents")
    return tuple(documents)


def parse_message_tool_fields(raw: dict[str, Any], role: str, index: int) -> dict[str, Any]:
    """A message's `tool_calls` (assistant), `tool_call_id` (tool) and `name`,
    as ChatMessage keyword arguments. A call's `arguments`, a JSON string on
    the wire, reach the template as the object it encodes: that is what
    templates written for HF expect (they `tojson` it)."""
    where = f"messages[{index}]"
    fields: dict[str, Any] = {}
    name = raw.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request(f"'{where}.name' must be a string", f"{where}.name")
        fields["name"] = name
    calls = raw.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise bad_request(f"'{where}.tool_calls' must be a list, on an assistant message",
                              f"{where}.tool_calls")
        fields["tool_calls"] = tuple(_message_call(c, f"{where}.tool_calls[{j}]")
                                     for j, c in enumerate(calls))
    call_id = raw.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise bad_request(f"'{where}.tool_call_id' is required on a tool message and must be a "
                          "string", f"{where}.tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise bad_request(f"'{where}.tool_call_id' must be a string", f"{where}.tool_call_id")
        fields["tool_call_id"] = call_id
    return fields


def _message_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"'{where}' must be {{\"id\", \"type\": \"function\", \"function\": "
                          "{\"name\": string, \"arguments\": JSON string}}", where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise bad_request(f"'{where}.function.arguments' is not valid JSON: {exc}",
                              f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"'{where}.function.arguments' must encode a JSON object",
                          f"{where}.function.arguments")
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def check_served(tools: ToolRequest | None, documents: tuple | None,
                 template_variables: Collection[str], parser: str | None) -> None:
    """400 when the served model cannot honour the request's tools or documents."""
    if documents is not None and "documents" not in template_variables:
        raise bad_request("'documents' is not supported: this model's chat template does not "
                          "read documents", "documents")
    if tools is None or not tools.parses_calls:
        return
    if "tools" not in template_variables:
        raise bad_request("'tools' is not supported: this model's chat template does not read "
                          "tools, so the model would never see them", "tools")
    if parser is None:
        raise bad_request("'tools' is not supported: the chat template shows no known tool-call "
                          "format; start the router with --tool-call-parser llama3_json or "
                          "hermes", "tools")
