"""Chat templates render exactly as Hugging Face transformers' apply_chat_template
renders them: a Qwen2.5-style and a Llama-3.1-style template (tests/tool_templates.py),
with and without tools, with tool calls and tool results, compared string for
string; and the environment's own pieces (undefined variables, tojson,
namespace, the generation block, raise_exception)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.chat_template import TemplateError, compile_chat_template, render_chat_template
from engine.tokenizer import Tokenizer
from tests.tool_templates import LLAMA31_STYLE, QWEN25_STYLE

transformers = pytest.importorskip("transformers")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather in a city (<b>metric</b> & imperial), e.g. Zürich",
        "parameters": {"type": "object",
                       "properties": {
                           "city": {"type": "string"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": {"type": "object", "properties": {}}}},
]
PLAIN = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Hello, who are you?"}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLED = [
    {"role": "system", "content": "You help with weather."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]
TWO_CALLS = [
    *ASK,
    {"role": "assistant", "content": "Let me check both.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "10:00"},
]


def _model_with(tiny_model_dir: Path, out: Path, template: str) -> Path:
    """The tiny model's tokenizer files with `template` (no weights: only tokenizers load)."""
    out.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "generation_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[Tokenizer, object]]:
    """family -> (our Tokenizer, transformers' tokenizer) over the same files."""
    pairs = {}
    for family, template in (("qwen", QWEN25_STYLE), ("llama", LLAMA31_STYLE)):
        model_dir = _model_with(tiny_model_dir, tmp_path_factory.mktemp(family), template)
        pairs[family] = (Tokenizer.from_pretrained(model_dir),
                         transformers.AutoTokenizer.from_pretrained(model_dir))
    return pairs


CASES = [
    ("qwen", PLAIN, None), ("qwen", ASK, TOOLS), ("qwen", CALLED, TOOLS),
    ("qwen", TWO_CALLS, TOOLS), ("qwen", CALLED, None),
    ("llama", PLAIN, None), ("llama", ASK, TOOLS), ("llama", CALLED, TOOLS),
    ("llama", CALLED, None),
]


@pytest.mark.parametrize("family, messages, tools", CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(tokenizers, family, messages, tools,
                                 add_generation_prompt) -> None:
    tok, hf = tokenizers[family]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                   tools=tools)
    theirs = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                    add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    # the tools reach the prompt (unescaped), and only when given
    assert ("Zürich" in ours and "<b>metric</b> & imperial" in ours) == (tools is not None)


def test_template_rejection_is_a_clear_error(tokenizers) -> None:
    tok, hf = tokenizers["llama"]
    with pytest.raises(Exception, match="only one tool call per message"):
        hf.apply_chat_template(TWO_CALLS, tools=TOOLS, tokenize=False)
    with pytest.raises(TemplateError, match="chat template rejected the messages: only one "
                                            "tool call per message is supported"):
        tok.apply_chat_template(TWO_CALLS, tools=TOOLS)


@pytest.mark.parametrize("source, variables, expected", [
    # undefined variables behave as in HF: falsy, empty, testable
    ("{{ missing }}|{% if tools %}t{% endif %}|{{ tools is none }}|{{ documents is defined }}",
     {}, "||True|True"),
    ("{{ bos_token is defined }}", {}, "False"),
    ("{{ {'a': '<&>', 'b': 'é'} | tojson }}", {}, '{"a": "<&>", "b": "é"}'),
    ("{{ {'b': 1, 'a': [1]} | tojson(indent=2, sort_keys=true) }}", {},
     '{\n  "a": [\n    1\n  ],\n  "b": 1\n}'),
    ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
     "{% endfor %}{{ ns.n }}", {}, "1"),
    ("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}"
     "{% break %}{% endfor %}", {}, "[hi]"),
    ("{{ dict(a=1)['a'] }}{{ strftime_now('%Y') | length }}", {}, "14"),
])
def test_environment(source, variables, expected) -> None:
    template = compile_chat_template(source)
    rendered = render_chat_template(template, [{"role": "user", "content": "hi"}],
                                    add_generation_prompt=False, **variables)
    assert rendered == expected


@pytest.mark.parametrize("source, message", [
    ("{{ raise_exception('no system messages') }}",
     "chat template rejected the messages: no system messages"),
    ("{% set ns = namespace(_x=1) %}", "chat template may not set namespace attribute '_x'"),
    ("{{ missing.attribute.deeper }}", "chat template failed to render: 'missing' is undefined"),
])
def test_environment_errors(source, message) -> None:
    template = compile_chat_template(source)
    with pytest.raises(TemplateError) as info:
        render_chat_template(template, [{"role": "user", "content": "hi"}],
                             add_generation_prompt=False)
    assert str(info.value) == message
