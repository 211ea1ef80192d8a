"""engine.detokenizer: streaming text never contains half a character."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def test_split_multibyte_characters_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("Hi 🦀 漢字!", add_special_tokens=False)
    # 🦀 and 漢/字 were never in the training corpus: byte tokens split them
    assert len(ids) == 13
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([token]) for token in ids]
    assert pieces == ["H", "i", "", "", " 🦀", " ", "", "", "漢", "", "", "字", "!"]
    assert detok.flush() == ""


@pytest.mark.parametrize("text", [
    "The quick brown fox 🙂 jumps — naïve café",
    "你好，世界。漢字テスト 🦀🦀 ok",
    "def f(x):\n    return x\n",
])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_chunks_concatenate_to_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + detok.flush() == text
    assert detok.token_ids == ids


def test_flush_emits_a_truncated_character_as_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🦀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    # a batch ending mid-character is held back whole until it completes
    assert detok.add(ids[:-1]) == ""
    assert detok.flush() == "ok \ufffd"
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = [*tok.encode("Hi", add_special_tokens=False), 4]  # 4 = <|eot_id|>
    skipping = IncrementalDetokenizer(tok)
    assert [skipping.add([t]) for t in ids] == ["H", "i", ""]
    keeping = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert [keeping.add([t]) for t in ids] == ["H", "i", "<|eot_id|>"]


def test_window_stays_short(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("the cat sat on the mat " * 50, add_special_tokens=False)
    for token in ids:
        detok.add([token])
        # only the last emitted token is kept as context for the next decode
        assert detok._read_offset - detok._prefix_offset <= 1
