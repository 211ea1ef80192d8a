"""Structured outputs: `GrammarSpec` (what a request's tokens must follow)
and `GrammarCompiler` (specs compiled by llguidance, cached).

A `GrammarSpec` is plain data: a kind (`json_schema`, `regex`, or
`grammar`: Lark or GBNF, as llguidance reads them) and its text. It travels
from the router's API (response_format, guided_json/choice/regex/grammar)
through `pdserve.v1.SamplingParams.grammar` into the engine's
`SamplingParams`; a request without one takes no grammar code at all.

`GrammarCompiler` turns a spec into an `llguidance.LLMatcher` over the
model's own tokenizer (tokenizer.json, the `tokenizers` JSON the engine and
the router encode with; eos ids as the engine stops on them). Compiling is
the expensive part (up to the fuel limits below), so each spec is compiled
once and kept, in its initial state, in an LRU cache; every request gets a
`deep_copy` of it (microseconds). The router compiles a request's spec once
to refuse a bad one with a 400 (the same function, so a spec the router
accepts compiles on the pods), and the pods compile it off the engine loop
thread before the request reaches the engine (`EngineLoop`), so the engine
thread only ever copies a cached matcher.

Limits (each refusal is a ValueError naming the limit): the spec's text is
at most `MAX_GRAMMAR_CHARS`; llguidance's own limits (`LIMITS`) bound the
grammar's size in symbols and the lexer work at compile time (~20 ms of
fuel) and per token mask (`LIMITS`).

Thread-safety: `compile` may be called from any thread (a lock guards the
cache; llguidance drops the GIL while it compiles). This module does not
import torch: the router imports it.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance

from proto import pdserve_pb2 as pb

MAX_GRAMMAR_CHARS = 64 * 1024
CACHE_SIZE = 256
# llguidance limits (its defaults, max_grammar_size and lexer states lower):
# grammar symbols; regex fuel at compile (~50k/ms) and per mask (~14k/ms);
# Earley items per mask; lexer states (1-2 kB each, built as masks need them).
LIMITS = dict(max_grammar_size=100_000, initial_lexer_fuel=1_000_000,
               step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=50_000)
# Compact JSON ("," and ":" without spaces): whitespace anywhere would let a
# model pad a document forever, and OpenAI's own outputs are compact.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: a JSON schema (json_object: {"type": "object"})
    REGEX = "regex"              # text: a regular expression (Rust regex syntax)
    GRAMMAR = "grammar"          # text: a Lark or GBNF grammar


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One request's grammar; hashable, the compile cache's key."""

    kind: GrammarKind
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GrammarKind):
            raise ValueError(f"grammar kind must be a GrammarKind, got {self.kind!r}")
        if not self.text:
            raise ValueError(f"the {self.kind.value} grammar is empty")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the {self.kind.value} grammar is {len(self.text)} characters; "
                             f"the limit is {MAX_GRAMMAR_CHARS}")

    @classmethod
    def json_schema(cls, schema: dict) -> GrammarSpec:
        """A schema as canonical JSON text (sorted keys), so equal schemas share a cache entry."""
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True,
                                                       separators=(",", ":")))


def grammar_from_proto(message: pb.SamplingParams) -> GrammarSpec | None:
    """The request's grammar (`pdserve.v1.Grammar`: the oneof's field name is
    the kind), or None when unset; ValueError when its text is empty or too
    long. The one reading of the wire's grammar, for the pods and the router."""
    kind = message.grammar.WhichOneof("spec") if message.HasField("grammar") else None
    return None if kind is None else GrammarSpec(GrammarKind(kind), getattr(message.grammar, kind))


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text of `spec`; ValueError when it cannot be read."""
    if spec.kind is GrammarKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS)
    if spec.kind is GrammarKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark


def build_tokenizer(tokenizer_json: str, vocab_size: int,
                    eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a `tokenizers` tokenizer (its JSON): `vocab_size`
    rows of mask (the model's, which may exceed the tokenizer's; ids past the
    tokenizer are never allowed), and the ids a finished grammar allows."""
    if not eos_token_ids:
        raise ValueError("a grammar needs the model's eos token ids; this model has none")
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                  eos_token=sorted(eos_token_ids))


def model_tokenizer(model_dir: str | Path, vocab_size: int,
                    eos_token_ids: Collection[int]) -> llguidance.LLTokenizer:
    """`build_tokenizer` for a model directory's tokenizer.json (what the
    engine's `GrammarCompiler` calls on the first grammar request)."""
    from engine.tokenizer import Tokenizer

    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: structured outputs "
                         "(grammars) need the model's tokenizer")
    tokenizer_json = Tokenizer.from_pretrained(model_dir).to_json()
    return build_tokenizer(tokenizer_json, vocab_size, sorted(eos_token_ids))


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one model and caches them (see module doc).

    `make_tokenizer` builds the llguidance tokenizer; it is called once, by
    the first `compile` (up to ~1 s for a 128k vocabulary, so off the hot
    path like every compile)."""

    def __init__(self, make_tokenizer: Callable[[], llguidance.LLTokenizer],
                 cache_size: int = CACHE_SIZE, limits: dict[str, int] = LIMITS) -> None:
        self._make_tokenizer = make_tokenizer
        self._limits = dict(limits)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> None:
        """Compile `spec` into the cache (any thread); ValueError with
        llguidance's reason when the spec is invalid or over a limit."""
        self._compiled(spec)

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher for one request, in the grammar's initial state."""
        return self._compiled(spec).deep_copy()

    def _compiled(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template
        tokenizer = self.tokenizer
        try:
            grammar = llguidance_grammar(spec)
        except ValueError as exc:
            raise ValueError(f"invalid {spec.kind.value}: {exc}") from None
        # Two threads may compile the same spec at once; both results are equal.
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                        limits=llguidance.LLParserLimits(**self._limits))
        if template.is_error():
            raise ValueError(f"invalid {spec.kind.value}: {_first_line(template.get_error())}")
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template


def _first_line(error: str) -> str:
    """llguidance's error without the parser-state dump it may append."""
    return error.strip().split("\n<state>", 1)[0].strip()
