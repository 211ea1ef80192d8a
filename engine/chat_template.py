"""Chat templates: rendering HF-style Jinja templates safely, and the
built-in models' template.

`render_chat_template` is called by `engine.tokenizer.Tokenizer.
apply_chat_template` (router threads, any thread: the compiled template is
immutable). Templates come from model directories, so they are untrusted:
they run in jinja2's ImmutableSandboxedEnvironment (no attribute access to
Python internals, no mutation of the messages).

No torch import here: the router imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
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


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per tokenizer; TemplateError when the syntax is bad."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        undefined=jinja2.StrictUndefined)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template has a syntax error at line {exc.lineno}: "
                            f"{exc.message}") from None


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages must be a non-empty list of {"role": str, "content": str}."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise TemplateError("messages must contain at least one message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TemplateError(f"messages[{i}].{key} must be a string, "
                                    f"got {type(message.get(key)).__name__}")
        checked.append(dict(message))
    return checked


def render_chat_template(template: jinja2.Template, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool, **special_tokens: str | None) -> str:
    """Render `messages` with the compiled template; special_tokens are the
    names templates expect (bos_token, eos_token)."""
    checked = validate_messages(messages)
    try:
        return template.render(messages=checked, add_generation_prompt=add_generation_prompt,
                               **special_tokens)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template failed to render: {exc}") from None
