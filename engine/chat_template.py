"""Chat templates: rendering HF-style Jinja templates safely, and the
built-in models' template.

`render_chat_template` is called by `engine.tokenizer.Tokenizer.
apply_chat_template` (router threads, any thread: the compiled template is
immutable). Templates come from model directories, so they are untrusted:
they run in jinja2's ImmutableSandboxedEnvironment (no attribute access to
Python internals, no mutation of the messages).

The environment is the one Hugging Face's `apply_chat_template` builds, so a
model's template renders here exactly as it does there:

* `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension
  (`{% break %}`), and a no-op `{% generation %}` block (HF uses it to mark
  assistant tokens for training masks; it renders its body unchanged);
* jinja2's default `Undefined`: a variable the caller did not pass (`tools`
  without tools, `documents`, a message's missing `tool_calls`) is falsy,
  renders as "" and fails only when used further (`undefined.x.y`), which is
  what templates written against HF expect (`{% if tools %}`);
* globals `raise_exception(msg)` (-> TemplateError, a ValueError: the
  client's request is refused with the template's message), `strftime_now(fmt)`
  (the server's local time, as HF), `dict` and `namespace` (`namespace`
  refuses underscore names, as HF's does);
* the `tojson` filter as HF overrides it: `json.dumps` without HTML
  escaping, with `indent`, `separators`, `sort_keys` and `ensure_ascii`
  (default False) options.

Variables a render receives: `messages`, `add_generation_prompt`, `tools`
and `documents` (None when not given, as HF passes them), and the special
tokens the tokenizer config names (`bos_token`, `eos_token`, `unk_token`,
`pad_token`; one the config does not set is left undefined, as HF does).

No torch import here: the router imports this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Llama 3 instruct layout: <|begin_of_text|>, then per message
# <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>, then the
# assistant header when a reply is wanted.
BUILTIN_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' ~ message['role'] ~ "
    "'; expected system, user or assistant') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


class TemplateError(ValueError):
    """A template failed to compile or render, or the messages are malformed.
    A ValueError: it is the caller's (or the model directory's) fault."""


def _raise_exception(message: str) -> None:
    # HF templates call raise_exception() to reject bad conversations.
    raise TemplateError(f"chat template rejected the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; HF's does not, and
    # templates written against HF put tool schemas in the prompt with it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in a template, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace(), refusing underscore attributes (a sandbox escape route)."""

    # no named `self`, as in jinja2.utils.Namespace: "self" may be one of the keys
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateError(f"chat template may not set namespace attribute {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per tokenizer; TemplateError when the syntax is bad."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template has a syntax error at line {exc.lineno}: "
                            f"{exc.message}") from None


def template_variables(source: str) -> frozenset[str]:
    """The variables the template `source` reads from its caller (e.g.
    "tools", "documents"), so a caller can refuse input the template would
    silently ignore. TemplateError when the syntax is bad."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template has a syntax error at line {exc.lineno}: "
                            f"{exc.message}") from None


def _check_content(message: Mapping[str, Any], where: str) -> None:
    content = message.get("content")
    if isinstance(content, str):
        return
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise TemplateError(f"{where}.content[{j}] must be a dict with a 'type'")
        return
    if content is None and message.get("tool_calls"):
        return  # an assistant turn that only calls tools
    raise TemplateError(f"{where}.content must be a string or a list of content parts, "
                        f"got {type(content).__name__}")


def _check_tool_calls(tool_calls: Any, where: str) -> None:
    if not isinstance(tool_calls, list):
        raise TemplateError(f"{where}.tool_calls must be a list, got {type(tool_calls).__name__}")
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TemplateError(f"{where}.tool_calls[{j}] must be a dict with "
                                "function.name a string")


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages must be a non-empty list of dicts with a string `role` and a
    `content` that is a string or a list of parts (None only beside
    `tool_calls`). Other keys (`tool_calls`, `tool_call_id`, `name`) pass
    through to the template as HF passes them."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise TemplateError("messages must contain at least one message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise TemplateError(f"messages[{i}].role must be a string, "
                                f"got {type(message.get('role')).__name__}")
        if message.get("tool_calls") is not None:
            _check_tool_calls(message["tool_calls"], f"messages[{i}]")
        _check_content(message, f"messages[{i}]")
        checked.append(dict(message))
    return checked


def render_chat_template(template: jinja2.Template, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool, tools: Sequence[Mapping] | None = None,
                         documents: Sequence[Mapping] | None = None,
                         **special_tokens: str | None) -> str:
    """Render `messages` with the compiled template. `tools` and `documents`
    are always passed, None when not given (as HF passes them: templates test
    `{% if tools %}` or `{% if tools is not none %}`); special_tokens are the
    names templates expect (bos_token, eos_token, ...), each passed only
    when set (HF leaves an unset one undefined)."""
    checked = validate_messages(messages)
    variables: dict[str, Any] = {k: v for k, v in special_tokens.items() if v is not None}
    try:
        return template.render(
            messages=checked, add_generation_prompt=add_generation_prompt,
            tools=None if tools is None else [dict(t) for t in tools],
            documents=None if documents is None else [dict(d) for d in documents],
            **variables)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template failed to render: {exc}") from None
