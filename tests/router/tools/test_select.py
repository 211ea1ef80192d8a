"""`--tool-call-parser`: the parser a chat template calls for, and the flag's choices."""

from __future__ import annotations

import pytest

from engine.chat_template import BUILTIN_CHAT_TEMPLATE
from router.config import TOOL_CALL_PARSERS, RouterConfig
from router.tools.hermes import HermesParser
from router.tools.llama3_json import Llama3JsonParser
from router.tools.select import TOOL_CALL_PARSER_CHOICES, make_parser, resolve_parser
from tests.tool_templates import LLAMA31_STYLE, QWEN25_STYLE

MISTRAL_LIKE = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"


@pytest.mark.parametrize("flag, template, expected", [
    ("auto", QWEN25_STYLE, "hermes"),
    ("auto", LLAMA31_STYLE, "llama3_json"),
    ("auto", BUILTIN_CHAT_TEMPLATE, None),
    ("auto", MISTRAL_LIKE, None),
    ("auto", None, None),
    ("hermes", LLAMA31_STYLE, "hermes"),  # the flag wins
    ("llama3_json", None, "llama3_json"),
])
def test_resolve_parser(flag, template, expected) -> None:
    assert resolve_parser(flag, template) == expected


def test_choices_agree_with_the_config() -> None:
    assert TOOL_CALL_PARSER_CHOICES == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, llama3_json, "
                                         "hermes, got 'xml'"):
        RouterConfig(model_dir="m", tool_call_parser="xml")
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        resolve_parser("xml", None)
    assert isinstance(make_parser("hermes"), HermesParser)
    assert make_parser("llama3_json", max_calls=1).max_calls == 1
    assert isinstance(make_parser("llama3_json"), Llama3JsonParser)
