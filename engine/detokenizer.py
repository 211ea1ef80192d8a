"""`IncrementalDetokenizer`: token ids in, newly completed text out.

One instance per output stream, used by whoever streams text: the router
(one per request, on its event loop) or `LLMEngine.generate()`. Not shared
between threads. No torch import (the router imports it).

Why incremental decoding needs care: a byte-level tokenizer may split one
character across tokens (an emoji is 4 bytes, a CJK character 3), so the
text of the tokens seen so far can end in half a character, which decodes to
U+FFFD. And decoding every token alone loses context some decoders need
(leading-space handling). So we decode a short window: the tokens since the
last emitted boundary (`prefix_offset`) up to the newest, and emit only the
part beyond what the window's already-emitted tokens produced — and only
when the result does not end in U+FFFD. Work per `add` is bounded by the
window, not by the length of the output.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Window path invariant: tokens[:read_offset] have been emitted as
    text; the text of tokens[prefix_offset:read_offset] is `decode(...)` of
    that window and was already emitted; prefix_offset <= read_offset <=
    len(tokens). Byte-level path: every byte of every id went into `_utf8`,
    which holds back at most an unfinished character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # the byte-level path (module doc); None: the window path
        self._pieces = tokenizer.byte_pieces(skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._utf8_holds = False  # `_utf8` holds the start of a character

    @property
    def token_ids(self) -> list[int]:
        """All ids added so far (a copy)."""
        return list(self._tokens)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._tokens[start:end],
                                      skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete ("" while a character
        is still partial). Concatenating every return value and `flush()`
        gives the decode of all ids."""
        if self._pieces is not None:
            return self._add_bytes(token_ids)
        self._tokens.extend(int(t) for t in token_ids)
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            # the tail is half a character (or decodes to nothing yet): hold it back
            return ""
        new_text = full_text[len(prefix_text):]
        # the window restarts at the old read point: tokens before it are done
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text

    def _add_bytes(self, token_ids: Sequence[int]) -> str:
        pieces, count = self._pieces, len(self._pieces)
        if len(token_ids) == 1:  # a decode step's one token: the router's common case
            token_id = int(token_ids[0])
            self._tokens.append(token_id)
            data = pieces[token_id] if 0 <= token_id < count else b""
        else:
            tokens, data = self._tokens, b""
            for token_id in token_ids:
                token_id = int(token_id)
                tokens.append(token_id)
                if 0 <= token_id < count:
                    data += pieces[token_id]
        if not data:
            return ""
        if not self._utf8_holds:
            try:  # the common case: whole characters, nothing held back
                return data.decode()
            except UnicodeDecodeError:
                pass
        text = self._utf8.decode(data)
        self._utf8_holds = bool(self._utf8.getstate()[0])
        return text

    def flush(self) -> str:
        """Text still held back (end of stream); a truncated character comes
        out as U+FFFD. The detokenizer is empty-handed afterwards."""
        if self._pieces is not None:
            self._utf8_holds = False
            return self._utf8.decode(b"", final=True)
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._tokens)
        return full_text[len(prefix_text):]
