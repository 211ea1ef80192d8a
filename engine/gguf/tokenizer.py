"""A GGUF file's tokenizer metadata as a Hugging Face `tokenizers.Tokenizer`.

Called by the GGUF converter (`engine.gguf.convert`), which saves the result
as `tokenizer.json`, and `GGUFTokenizer.tokenizer_config()` as
`tokenizer_config.json`, so the project's `engine.tokenizer.Tokenizer` (and
transformers) read a GGUF model like any other. Torch- and transformers-free:
the router resolves models too. It takes the metadata as a plain mapping
(`engine.gguf.reader.open_gguf(path).metadata`), so tests need no file.

The rules are llama.cpp's (`src/llama-vocab.cpp`), since a GGUF means what
llama.cpp does with it:

- `tokenizer.ggml.model` "gpt2": byte-level BPE. Vocabulary and merges come
  from the file; the pre-tokenizer from `tokenizer.ggml.pre`, the name of
  the split regexes llama.cpp applies (an unknown name is refused rather
  than guessed: the wrong split silently changes the ids).
- "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral). The file
  has scores, not merges: every split of a normal token into two vocabulary
  tokens is a merge, ranked by the token's score, which is SentencePiece's
  merge priority. A space prefix ("▁") is added to each text run, as
  llama.cpp and SentencePiece do.
- Tokens typed CONTROL (or UNKNOWN) become special added tokens and
  USER_DEFINED ones plain added tokens, so they match whole; every token
  keeps its GGUF id (the model's embedding rows).
- BOS is not added by a post-processor: `engine.tokenizer.Tokenizer`
  prepends it when `add_bos_token` says so.

Every problem raises `CheckpointError` naming the file, the key and what was
expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from engine.errors import CheckpointError

# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"  # SentencePiece's "▁", the spelling of a space in its pieces

# The original `tokenizer.json` regexes that llama.cpp quotes for each type
# (its own copies are rewritten for its regex engine, not for Oniguruma).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True, slots=True)
class _Pre:
    """How one `tokenizer.ggml.pre` value pre-tokenizes a byte-level BPE."""

    split: str | None = None  # a regex isolated first; None: GPT-2's, built into ByteLevel
    digits: bool = False  # every number character on its own first (llama.cpp's `\p{N}`)
    ignore_merges: bool = False  # a word already in the vocabulary is one token
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_GPT2, _DIGITS = _Pre(), _Pre(digits=True)
_LLAMA3 = _Pre(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = _Pre(_QWEN2_SPLIT)

PRE_TOKENIZERS: dict[str, _Pre] = {
    # "default" (also what a file without the key gets): llama.cpp runs a
    # legacy regex set here and warns that output degrades; GPT-2's own
    # regex is the likelier original of an old byte-level file.
    **dict.fromkeys(["default", "gpt-2", "phi-2", "mpt", "olmo", "jais"], _GPT2),
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell",
                     "exaone", "minerva-7b"], _DIGITS),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                     "pixtral", "midm-2.0", "lfm2"], _LLAMA3),
    # same regex as Llama 3, without llama.cpp's ignore_merges / BOS default
    **dict.fromkeys(["dbrx", "smaug-bpe"], _Pre(_LLAMA3_SPLIT)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"], _QWEN2),
}

SUPPORTED_MODELS = ("gpt2", "llama")


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    """A GGUF file's tokenizer and the tokenizer_config.json facts."""

    tokenizer: tokenizers.Tokenizer  # ready to save as tokenizer.json
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    def tokenizer_config(self, model_max_length: int) -> dict[str, Any]:
        """tokenizer_config.json's content; special tokens only where set."""
        config: dict[str, Any] = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(self, name)
            if value is not None:
                config[name] = value
        config["add_bos_token"] = self.add_bos_token
        config["add_eos_token"] = self.add_eos_token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        config["model_max_length"] = model_max_length
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        # decode() must give back the text exactly (streaming depends on it)
        config["clean_up_tokenization_spaces"] = False
        return config


def build_tokenizer(metadata: Mapping[str, Any], source: str) -> GGUFTokenizer:
    """The tokenizer described by `metadata` (GGUF keys -> values) of the
    file `source`, which error messages name."""
    meta = _Metadata(metadata, source)
    model = meta.get("tokenizer.ggml.model", str, required=True)
    if model not in SUPPORTED_MODELS:
        raise CheckpointError(f"{source}: tokenizer.ggml.model {model!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_MODELS)})")
    tokens = meta.list_of("tokenizer.ggml.tokens", str, required=True)
    _check_unique(tokens, source)
    types = meta.list_of("tokenizer.ggml.token_type", int, length=len(tokens))
    types = types if types is not None else [NORMAL] * len(tokens)
    merges = meta.list_of("tokenizer.ggml.merges", str)
    if model == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", str, "default")
        if pre not in PRE_TOKENIZERS:
            raise CheckpointError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported "
                                  f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
        pairs = _parse_merges(merges or [], source)
        tokenizer = _byte_level(tokens, pairs, PRE_TOKENIZERS[pre], source)
        add_bos_default = PRE_TOKENIZERS[pre].add_bos
    else:
        tokenizer = _sentencepiece(meta, tokens, types, merges)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    _add_special_tokens(tokenizer, tokens, types, source)
    special = {name: meta.token(key, tokens) for name, key in (
        ("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id"),
        ("pad", "tokenizer.ggml.padding_token_id"), ("unk", "tokenizer.ggml.unknown_token_id"))}
    return GGUFTokenizer(
        tokenizer=tokenizer,
        bos_token=special["bos"], eos_token=special["eos"],
        pad_token=special["pad"], unk_token=special["unk"],
        add_bos_token=meta.get("tokenizer.ggml.add_bos_token", bool, add_bos_default),
        add_eos_token=meta.get("tokenizer.ggml.add_eos_token", bool, False),
        chat_template=meta.get("tokenizer.chat_template", str),
    )


class _Metadata:
    """Typed access to the metadata, with errors that name the file and key."""

    def __init__(self, metadata: Mapping[str, Any], source: str) -> None:
        self.metadata, self.source = metadata, source

    def _fail(self, key: str, expected: str, value: Any) -> CheckpointError:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return CheckpointError(f"{self.source}: {key} must be {expected}, got {shown}")

    def get(self, key: str, kind: type, default: Any = None, *, required: bool = False) -> Any:
        if key not in self.metadata:
            if required:
                raise CheckpointError(f"{self.source}: metadata key {key} is missing "
                                      f"(expected {kind.__name__})")
            return default
        value = self.metadata[key]
        # a bool is an int in Python, but a flag where a number belongs is wrong
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise self._fail(key, kind.__name__, value)
        return value

    def list_of(self, key: str, kind: type | tuple[type, ...], *, required: bool = False,
                length: int | None = None) -> list[Any] | None:
        value = self.get(key, list, required=required)
        if value is None:
            return None
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        for index, item in enumerate(value):
            if not isinstance(item, kind) or isinstance(item, bool):
                raise self._fail(f"{key}[{index}]", name, item)
        if length is not None and len(value) != length:
            raise CheckpointError(f"{self.source}: {key} has {len(value)} entries, expected "
                                  f"{length} (one per tokenizer.ggml.tokens entry)")
        return value

    def token(self, key: str, tokens: Sequence[str]) -> str | None:
        """The token a `*_token_id` key names, None when the key is absent."""
        token_id = self.get(key, int)
        if token_id is None:
            return None
        if not 0 <= token_id < len(tokens):
            raise CheckpointError(f"{self.source}: {key} {token_id} is out of range "
                                  f"(expected 0 <= id < {len(tokens)}, the vocabulary size)")
        return tokens[token_id]


def _check_unique(tokens: Sequence[str], source: str) -> None:
    # a token string is the vocabulary's key: a repeat or an empty one would
    # leave an id that no text encodes to and that decodes to nothing
    seen: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not token:
            raise CheckpointError(f"{source}: tokenizer.ggml.tokens[{index}] is empty "
                                  "(expected a non-empty token)")
        if token in seen:
            raise CheckpointError(f"{source}: tokenizer.ggml.tokens[{index}] {token!r} repeats "
                                  f"token {seen[token]} (expected unique tokens)")
        seen[token] = index


def _parse_merges(merges: Sequence[str], source: str) -> list[tuple[str, str]]:
    pairs = []
    for index, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise CheckpointError(f"{source}: tokenizer.ggml.merges[{index}] {merge!r} is not "
                                  "two tokens separated by one space")
        pairs.append((left, right))
    return pairs


def _bpe(source: str, **kwargs: Any) -> models.BPE:
    try:
        return models.BPE(**kwargs)
    except Exception as exc:  # the Rust side reports a merge whose tokens are unknown
        raise CheckpointError(f"{source}: tokenizer.ggml.merges do not fit "
                              f"tokenizer.ggml.tokens: {exc}") from None


def _byte_level(tokens: Sequence[str], merges: list[tuple[str, str]], pre: _Pre,
                source: str) -> tokenizers.Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = tokenizers.Tokenizer(_bpe(source, vocab=vocab, merges=merges,
                                          ignore_merges=pre.ignore_merges))
    if pre.split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pre.split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre.digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _sentencepiece(meta: _Metadata, tokens: Sequence[str], types: Sequence[int],
                   merges: Sequence[str] | None) -> tokenizers.Tokenizer:
    if merges is not None:
        pairs = _parse_merges(merges, meta.source)
    else:
        scores = meta.list_of("tokenizer.ggml.scores", (float, int), required=True,
                              length=len(tokens))
        pairs = _merges_from_scores(tokens, types, scores)
    unk = meta.token("tokenizer.ggml.unknown_token_id", tokens)
    if unk is None:
        unk = next((t for t, kind in zip(tokens, types, strict=True) if kind == UNKNOWN), None)
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = tokenizers.Tokenizer(_bpe(meta.source, vocab=vocab, merges=pairs,
                                          unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", bool, True)
    steps = [normalizers.Replace(" ", SPACE)]
    # Prepend runs on every text run between added tokens, as llama.cpp
    # prefixes each run that follows a special token
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), *steps] if prefix else steps)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(
        [*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tokenizer


def _merges_from_scores(tokens: Sequence[str], types: Sequence[int],
                        scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges: each split of a normal token into two
    vocabulary tokens, the highest-scored result first (SentencePiece merges
    the best-scored pair first); ties by the ids of the two halves."""
    ids = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for index, piece in enumerate(tokens):
        if types[index] != NORMAL:
            continue  # bytes, control and added tokens are never merge results
        for cut in range(1, len(piece)):
            left, right = ids.get(piece[:cut]), ids.get(piece[cut:])
            if left is not None and right is not None:
                ranked.append((-scores[index], left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, left, right in ranked]


def _add_special_tokens(tokenizer: tokenizers.Tokenizer, tokens: Sequence[str],
                        types: Sequence[int], source: str) -> None:
    """CONTROL and UNKNOWN tokens as special added tokens, USER_DEFINED ones
    as plain added tokens: llama.cpp matches all three whole in the text
    before BPE. Each is already in the vocabulary, so it keeps its id."""
    special = [index for index, kind in enumerate(types) if kind in (CONTROL, UNKNOWN)]
    plain = [index for index, kind in enumerate(types) if kind == USER_DEFINED]
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in special])
    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i in plain])
    for index in special + plain:
        if tokenizer.token_to_id(tokens[index]) != index:
            raise CheckpointError(f"{source}: tokenizer.ggml.tokens[{index}] {tokens[index]!r} "
                                  "could not keep its id as an added token")
