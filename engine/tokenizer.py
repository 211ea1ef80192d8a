"""`Tokenizer`: a model directory's tokenizer.json + tokenizer_config.json.

Used by the router (tokenize once, apply the chat template, detokenize the
stream) and by `LLMEngine.generate()`. Must not import torch: the router
imports it. A Tokenizer is immutable after construction; the underlying
`tokenizers.Tokenizer` is thread-safe for encode/decode, so router threads
and event loops may share one instance.

Special tokens: `encode(..., add_special_tokens=True)` runs tokenizer.json's
post-processor (Llama 3 adds <|begin_of_text|> there) and, when
tokenizer_config.json says `add_bos_token` and the post-processor did not add
BOS, prepends it. A rendered chat template already starts with BOS, so chat
prompts are encoded with `encode_chat`, which does not add it again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

from engine.chat_template import (
    compile_chat_template,
    render_chat_template,
    template_variables,
)
from engine.errors import CheckpointError


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: file not found")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot parse JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores special tokens as "text" or {"content": "text", ...}
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level alphabet's character -> byte: printable Latin-1 bytes
    stand for themselves; the other 68 (controls, space, NBSP, soft hyphen)
    are U+0100 onwards in byte order (GPT-2's scheme, used by every
    byte-level BPE)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = sorted(set(range(256)) - set(printable))
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return alphabet


def _byte_level_pieces(hf: tokenizers.Tokenizer, skip_special_tokens: bool
                       ) -> tuple[bytes, ...]:
    """What the byte-level decoder makes of each id alone: a token whose
    characters are all in the alphabet is those bytes, any other token (an
    added token with a space, say) its UTF-8; skipped special tokens and
    ids with no token are empty (`decode` drops them)."""
    alphabet = _byte_level_alphabet()
    special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    pieces = []
    for token_id in range(hf.get_vocab_size(with_added_tokens=True)):
        token = hf.id_to_token(token_id)
        if token is None or (skip_special_tokens and token_id in special):
            pieces.append(b"")
            continue
        mapped = [alphabet.get(c) for c in token]
        pieces.append(token.encode() if None in mapped else bytes(mapped))
    return tuple(pieces)


class Tokenizer:
    """Text <-> token ids for one model. Build with `from_pretrained`."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_tokens: Sequence[str] = (), extra_eos_token_ids: Sequence[int] = (),
                 add_bos_token: bool = False, chat_template: str | None = None,
                 template_tokens: Mapping[str, str] | None = None,
                 source: str = "<memory>") -> None:
        self._tok = hf_tokenizer
        self._source = source
        self.bos_token = bos_token
        self.bos_token_id = self._id_of(bos_token) if bos_token is not None else None
        eos_ids = [self._id_of(t) for t in eos_tokens] + list(extra_eos_token_ids)
        # dict.fromkeys keeps first-seen order while dropping duplicates
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        # The names the template reads ("tools", "documents", ...): the router
        # refuses input the template would silently drop.
        self.template_variables = (template_variables(chat_template) if chat_template
                                   else frozenset())
        # Special tokens besides BOS/EOS that HF passes to templates (unk_token, pad_token)
        self._template_tokens = dict(template_tokens or {})
        self._byte_pieces: dict[bool, tuple[bytes, ...] | None] = {}

    def _id_of(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise CheckpointError(
                f"{self._source}: special token {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json (required), tokenizer_config.json and
        generation_config.json (optional; its eos_token_id list adds to the
        stop tokens, as HF generation does)."""
        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise CheckpointError(f"{tok_path}: file not found")
        try:
            hf = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise CheckpointError(f"{tok_path}: cannot load tokenizer: {exc}") from None
        config = _read_json(model_dir / "tokenizer_config.json", required=False)
        generation = _read_json(model_dir / "generation_config.json", required=False)
        eos = _token_text(config.get("eos_token"))
        gen_eos = generation.get("eos_token_id")
        gen_eos_ids = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else gen_eos
        template = config.get("chat_template")
        if template is not None and not isinstance(template, str):
            # a list of named templates: use "default" like HF does
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(
            hf,
            bos_token=_token_text(config.get("bos_token")),
            eos_tokens=[eos] if eos is not None else [],
            extra_eos_token_ids=[int(t) for t in gen_eos_ids],
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template,
            template_tokens={name: text for name in ("unk_token", "pad_token")
                             if (text := _token_text(config.get(name))) is not None},
            source=str(tok_path),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, special tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as `tokenizers` JSON (what tokenizer.json holds): the
        form llguidance builds its token table from (engine/grammar.py)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, BOS first (see module doc)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 at either end decodes to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def byte_pieces(self, skip_special_tokens: bool = True) -> tuple[bytes, ...] | None:
        """Each id's bytes in `decode`'s output, indexed by id, when the
        tokenizer's decoder is byte-level (GPT-2, Llama 3, Qwen): `decode(ids)`
        is then the lossy UTF-8 decode of the ids' pieces joined, so a stream
        can be detokenized by table lookup (engine.detokenizer). None for
        any other decoder (SentencePiece's Metaspace, byte fallback, ...).
        Built on first use per flag, then kept (a race builds it twice, alike)."""
        key = bool(skip_special_tokens)
        if key not in self._byte_pieces:
            self._byte_pieces[key] = (_byte_level_pieces(self._tok, key)
                                      if isinstance(self._tok.decoder, ByteLevelDecoder)
                                      else None)
        return self._byte_pieces[key]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None) -> str:
        """Render a conversation ([{"role", "content"}, ...], tool calls and
        tool results as HF passes them) to the prompt text, with `tools`
        (OpenAI function schemas) and `documents` as HF passes them.
        ValueError when the model has no template or the messages are
        malformed or rejected by the template."""
        if self._template is None:
            raise ValueError(f"{self._source}: this model has no chat template; "
                             "use a completion request with a plain prompt")
        return render_chat_template(self._template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    tools=tools, documents=documents,
                                    bos_token=self.bos_token, eos_token=self.eos_token,
                                    **self._template_tokens)

    def encode_chat(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True, *,
                    tools: list[dict[str, Any]] | None = None,
                    documents: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered conversation. The template writes its
        own special tokens (BOS included), so none are added here."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, documents=documents)
        return self.encode(text, add_special_tokens=False)
