"""engine.detokenizer: streaming text never contains half a character, and
concatenates to the tokenizer's own decode; both paths (the byte-level
table and the decode window)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tokenizers

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_level(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def window(tiny_model_dir: Path) -> Tokenizer:
    """The same tokenizer, forced onto the decode-window path."""
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    tokenizer._byte_pieces = {True: None, False: None}
    return tokenizer


@pytest.fixture(scope="module", params=["byte_level", "window"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


def test_the_built_in_tokenizer_takes_the_byte_level_path(byte_level: Tokenizer,
                                                          window: Tokenizer) -> None:
    assert IncrementalDetokenizer(byte_level)._pieces is not None
    assert IncrementalDetokenizer(window)._pieces is None


@pytest.mark.parametrize(("path", "expected"), [
    # the window holds back what precedes an unfinished character in its window
    ("window", ["H", "i", "", "", " 🦀", " ", "", "", "漢", "", "", "字", "!"]),
    # the byte-level path holds back only the unfinished character
    ("byte_level", ["H", "i", " ", "", "🦀", " ", "", "", "漢", "", "", "字", "!"]),
])
def test_split_multibyte_characters_are_held_back(request: pytest.FixtureRequest, path: str,
                                                  expected: list[str]) -> None:
    tok = request.getfixturevalue(path)
    ids = tok.encode("Hi 🦀 漢字!", add_special_tokens=False)
    # 🦀 and 漢/字 were never in the training corpus: byte tokens split them
    assert len(ids) == 13
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([token]) for token in ids]
    assert pieces == expected
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
    # a batch ending mid-character: at most its whole text is held back
    held = detok.add(ids[:-1])
    assert held in ("", "ok ")
    assert held + detok.flush() == "ok \ufffd"
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = [*tok.encode("Hi", add_special_tokens=False), 4]  # 4 = <|eot_id|>
    skipping = IncrementalDetokenizer(tok)
    assert [skipping.add([t]) for t in ids] == ["H", "i", ""]
    keeping = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert [keeping.add([t]) for t in ids] == ["H", "i", "<|eot_id|>"]


def test_window_stays_short(window: Tokenizer) -> None:
    tok = window
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("the cat sat on the mat " * 50, add_special_tokens=False)
    for token in ids:
        detok.add([token])
        # only the last emitted token is kept as context for the next decode
        assert detok._read_offset - detok._prefix_offset <= 1


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_concatenate_to_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    """Any ids (byte tokens that make invalid UTF-8, special tokens, ids past
    the tokenizer's vocabulary as a padded model head samples them), in
    random batches: the pieces join to `decode` of the ids it knows."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size + 8) for _ in range(rng.randrange(1, 48))]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        pieces, i = [], 0
        while i < len(ids):
            size = rng.randrange(1, 4)
            pieces.append(detok.add(ids[i:i + size]))
            i += size
        known = [t for t in ids if t < tok.vocab_size]
        assert "".join(pieces) + detok.flush() == tok.decode(
            known, skip_special_tokens=skip_special_tokens), f"seed {seed}, ids {ids}"


def test_added_tokens_decode_as_the_tokenizer_does(tiny_model_dir: Path) -> None:
    """An added token outside the byte alphabet (a space) is its UTF-8; one
    inside it ("ñandú": each letter stands for one byte) is those bytes, as
    the byte-level decoder makes them (invalid UTF-8 here); special ones
    are skipped or kept."""
    hf = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    hf.add_tokens(["hello world", "ñandú"])
    hf.add_special_tokens(["<|x y|>"])
    tok = Tokenizer(hf)
    assert tok.byte_pieces() is not None
    size = tok.vocab_size
    ids = [size - 3, *tok.encode(" token", add_special_tokens=False), size - 2, size - 1]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        text = "".join(detok.add([t]) for t in ids) + detok.flush()
        assert text == tok.decode(ids, skip_special_tokens=skip)
        assert text.startswith("hello world token")
        assert text.endswith("" if skip else "<|x y|>")


def test_other_decoders_take_the_window_path() -> None:
    """A SentencePiece-style decoder (Metaspace) has no byte table."""
    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    hf.decoder = tokenizers.decoders.Metaspace()
    tok = Tokenizer(hf)
    assert tok.byte_pieces() is None
    detok = IncrementalDetokenizer(tok)
    assert detok._pieces is None
    assert detok.add([1]) + detok.add([2]) + detok.flush() == tok.decode([1, 2]) == "hello world"
