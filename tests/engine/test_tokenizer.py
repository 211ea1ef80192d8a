"""engine.tokenizer on the built-in model's tokenizer files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import CheckpointError
from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2\n\n",
    "naïve café — 你好，世界 🙂🚀 漢字 🦀 Ελληνικά",
    "  leading and trailing spaces  ",
    "",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi! "}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def test_special_tokens_and_vocab(tok: Tokenizer) -> None:
    assert tok.bos_token == "<|begin_of_text|>" and tok.bos_token_id == 0
    # tokenizer_config's eos (<|eot_id|>) first, then generation_config's list
    assert tok.eos_token_ids == (4, 1)
    assert tok.vocab_size == 1100


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_unseen_characters_fall_back_to_bytes(tok: Tokenizer) -> None:
    # 🦀 is 4 UTF-8 bytes the corpus never saw: it needs several tokens
    ids = tok.encode("🦀", add_special_tokens=False)
    assert len(ids) > 1
    assert tok.decode(ids) == "🦀"
    assert tok.decode(ids[:1]) == "\ufffd"


def test_chat_template(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(MESSAGES) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith(
        "Hi!<|eot_id|>")


def test_encode_chat_has_one_bos_and_special_tokens_as_single_ids(tok: Tokenizer) -> None:
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids[1] == 2  # <|start_header_id|>
    assert ids.count(4) == 2  # two <|eot_id|>
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("messages, message", [
    ([], "messages must contain at least one message"),
    ("hello", "messages must be a list of dicts, got str"),
    ([{"role": "user"}],
     "messages[0].content must be a string or a list of content parts, got NoneType"),
    ([{"role": "user", "content": 3}],
     "messages[0].content must be a string or a list of content parts, got int"),
    ([{"role": 1, "content": "x"}], "messages[0].role must be a string, got int"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
     "messages[0].tool_calls[0] must be a dict with function.name a string"),
    ([{"role": "robot", "content": "x"}],
     "chat template rejected the messages: unknown role robot; expected system, user or "
     "assistant"),
])
def test_bad_messages(tok: Tokenizer, messages, message: str) -> None:
    with pytest.raises(ValueError) as info:
        tok.apply_chat_template(messages)
    assert str(info.value) == message


def _copy_with(tiny_model_dir: Path, tmp_path: Path, **config_changes) -> Path:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(config_changes)
    path.write_text(json.dumps(config))
    return model_dir


def test_template_syntax_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_with(tiny_model_dir, tmp_path, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="chat template has a syntax error at line 1"):
        Tokenizer.from_pretrained(model_dir)


def test_sandbox_blocks_python_internals(tiny_model_dir: Path, tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_pretrained(_copy_with(tiny_model_dir, tmp_path, chat_template=template))
    with pytest.raises(ValueError, match="chat template failed to render"):
        tok.apply_chat_template(MESSAGES)


def test_no_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_copy_with(tiny_model_dir, tmp_path, chat_template=None))
    with pytest.raises(ValueError, match="this model has no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_add_bos_token_without_post_processor(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_with(tiny_model_dir, tmp_path)
    raw = json.loads((model_dir / "tokenizer.json").read_text())
    raw["post_processor"] = None
    (model_dir / "tokenizer.json").write_text(json.dumps(raw))
    tok = Tokenizer.from_pretrained(model_dir)
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == [0, *plain]


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="tokenizer.json: file not found"):
        Tokenizer.from_pretrained(tmp_path)


def test_import_does_not_pull_torch() -> None:
    code = "import sys, engine.tokenizer, engine.detokenizer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
