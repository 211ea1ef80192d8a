"""Grammar compilation (engine/grammar.py) and the batched token mask
(engine/grammar_batch.py) against plain per-token reference computations."""

from __future__ import annotations

import json

import jsonschema
import pytest
import tokenizers
import tokenizers.trainers
import torch

from engine.grammar import (
    LIMITS,
    MAX_GRAMMAR_CHARS,
    GrammarCompiler,
    GrammarKind,
    GrammarSpec,
    build_tokenizer,
    model_tokenizer,
)
from engine.grammar_batch import GrammarBatch, TokenMask, unpack_bitmask
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

VOCAB = 1100  # the tiny model's
EOS = (1, 4)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> GrammarCompiler:
    return GrammarCompiler(lambda: model_tokenizer(tiny_model_dir, VOCAB, EOS))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def _request(request_id: str, spec: GrammarSpec, outputs=()) -> Request:
    return Request(request_id, [5, 6], SamplingParams(grammar=spec, max_tokens=50),
                   output_token_ids=outputs)


def _reference_allowed(matcher, vocab: int) -> list[bool]:
    """One matcher's mask through llguidance's one-byte-per-token API
    (no bitmask, no batch), read in a plain loop."""
    return [byte != 0 for byte in matcher.compute_logit_bias()[:vocab]]


def _grammar_allows(matcher, vocab: int) -> list[bool]:
    """Token by token: does the grammar take it next? A mask may allow fewer
    (llguidance also refuses tokens that would tokenize forced text
    non-canonically, e.g. '{' where '{"' is one token), never more."""
    return [matcher.validate_tokens([t]) == 1 for t in range(vocab)]


def test_spec_limits_and_canonical_schema_text():
    assert (GrammarSpec.json_schema({"b": 1, "a": {"d": 2, "c": 3}})
            == GrammarSpec.json_schema({"a": {"c": 3, "d": 2}, "b": 1}))
    with pytest.raises(ValueError, match=f"the limit is {MAX_GRAMMAR_CHARS}"):
        GrammarSpec(GrammarKind.REGEX, "a" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(ValueError, match="empty"):
        GrammarSpec(GrammarKind.GRAMMAR, "")


@pytest.mark.parametrize(("spec", "reason"), [
    (GrammarSpec.json_schema({"type": "objectx"}), "Invalid type: objectx"),
    (GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}),
     "minimum (5) is greater than maximum (1)"),
    (GrammarSpec.json_schema({"$ref": "#/nope"}), "'/nope' does not exist"),
    (GrammarSpec(GrammarKind.REGEX, "(("), "unclosed group"),
    (GrammarSpec(GrammarKind.GRAMMAR, "start: foo"), 'unknown name: "foo"'),
], ids=["type", "range", "ref", "regex", "lark"])
def test_invalid_grammars_are_refused_with_the_reason(compiler, spec, reason):
    with pytest.raises(ValueError, match="invalid") as info:
        compiler.compile(spec)
    assert reason in str(info.value)


def test_grammar_over_the_size_limit_is_refused(compiler):
    small = GrammarCompiler(lambda: compiler.tokenizer, limits={**LIMITS, "max_grammar_size": 50})
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}}
    with pytest.raises(ValueError, match=r"grammar size .* too big \(limit for this grammar: 50"):
        small.compile(GrammarSpec.json_schema(schema))
    compiler.compile(GrammarSpec.json_schema(schema))  # well within the real limit


def test_compiled_once_and_each_request_gets_its_own_state(compiler, tokenizer):
    spec = GrammarSpec(GrammarKind.REGEX, "(yes|no)")
    first, second = compiler.matcher(spec), compiler.matcher(spec)
    assert first.consume_tokens(tokenizer.encode("yes", add_special_tokens=False))
    assert first.is_stopped() and not second.is_stopped()  # copies, not shared
    assert second.consume_tokens(tokenizer.encode("no", add_special_tokens=False))
    small = GrammarCompiler(lambda: compiler.tokenizer, cache_size=1)
    small.compile(spec)
    small.compile(GrammarSpec(GrammarKind.REGEX, "a+"))
    assert list(small._cache) == [GrammarSpec(GrammarKind.REGEX, "a+")]  # LRU of size 1


def test_batched_mask_equals_per_token_reference(compiler, tokenizer):
    """Rows in several states (start, mid-document, complete) and a row of a
    request without grammar: one bitmask for the grammar rows, equal to the
    per-token reference; eos only where the grammar accepts."""
    batch = GrammarBatch(compiler, VOCAB)
    json_spec = GrammarSpec.json_schema(SCHEMA)
    regex_spec = GrammarSpec(GrammarKind.REGEX, "a+")
    mid = tokenizer.encode('{"n":4', add_special_tokens=False)
    requests = [_request("start", json_spec), _request("mid", json_spec, mid),
                Request("free", [5], SamplingParams()),
                _request("done", regex_spec, tokenizer.encode("aa", add_special_tokens=False))]
    for r in requests:
        if r.sampling_params.grammar is not None:
            batch.start(r)
    mask = batch.mask(requests)
    assert mask.rows == (0, 1, 3)
    allowed = unpack_bitmask(mask.bitmask, VOCAB)
    for row, request in zip(mask.rows, (requests[0], requests[1], requests[3]), strict=True):
        reference = compiler.matcher(request.sampling_params.grammar)
        reference.consume_tokens(request.output_token_ids)
        row_allowed = allowed[mask.rows.index(row)].tolist()
        assert row_allowed == _reference_allowed(reference, VOCAB)
        valid = _grammar_allows(reference, VOCAB)
        assert any(row_allowed) and all(valid[t] for t in range(VOCAB) if row_allowed[t])
    start, middle, done = allowed.tolist()
    assert not any(start[t] for t in EOS)  # a document starts with '{'
    assert not any(middle[t] for t in EOS) and sum(middle) > 2  # more digits or '}'
    assert all(done[t] for t in EOS)  # "aa" is accepted: eos allowed, and more "a"s
    assert batch.mask([requests[2]]) is None
    for r in requests:
        batch.drop(r.request_id)
    assert len(batch) == 0 and batch.mask(requests) is None


def test_unpack_bitmask_against_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 5), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    allowed = unpack_bitmask(bitmask, 150)
    for r in range(3):
        for t in range(150):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            assert bool(allowed[r, t]) == bool(word >> (t % 32) & 1)


@pytest.mark.parametrize("rows", [(0, 1, 2), (1,), (0, 2)])
def test_token_mask_apply_against_reference(rows):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 70, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), 3), generator=g,
                            dtype=torch.int64).to(torch.int32)
    with torch.inference_mode():  # the model's logits are inference tensors
        masked = TokenMask(rows, bitmask).apply(logits.clone())
    expected = logits.clone()
    allowed = unpack_bitmask(bitmask, 70)
    for i, r in enumerate(rows):
        for t in range(70):
            if not allowed[i, t]:
                expected[r, t] = float("-inf")
    assert torch.equal(masked, expected)


def test_output_tokens_that_break_the_grammar_are_refused(compiler, tokenizer):
    batch = GrammarBatch(compiler, VOCAB)
    spec = GrammarSpec.json_schema(SCHEMA)
    with pytest.raises(ValueError, match="output_token_ids do not follow"):
        batch.start(_request("r", spec, tokenizer.encode("nope", add_special_tokens=False)))
    batch.start(_request("r", spec))
    with pytest.raises(ValueError, match="does not follow"):
        batch.check_next("r", tokenizer.encode("x", add_special_tokens=False)[0])
    batch.check_next("r", tokenizer.encode("{", add_special_tokens=False)[0])


def test_json_schema_grammar_is_compact(compiler, tokenizer):
    """No whitespace between JSON tokens: a model cannot pad a document forever."""
    matcher = compiler.matcher(GrammarSpec.json_schema(SCHEMA))
    text = json.dumps({"n": 7}, separators=(",", ":"))
    assert matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    assert matcher.is_stopped()
    spaced = compiler.matcher(GrammarSpec.json_schema(SCHEMA))
    assert not spaced.consume_tokens(tokenizer.encode('{ "n": 7}', add_special_tokens=False))


def _sentencepiece_style_tokenizer() -> tokenizers.Tokenizer:
    """A Llama-2-style tokenizer.json: "▁" for spaces, a "▁" prepended, byte
    fallback tokens <0x00>..<0xFF>; trained here on a little JSON."""
    from tokenizers import decoders, models, normalizers

    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                             show_progress=False)
    tok.train_from_iterator(['{"name": "Paris", "n": 12} the quick brown fox'] * 20, trainer)
    return tok


def test_a_sentencepiece_style_tokenizer_yields_valid_documents():
    """Byte-fallback and "▁" tokens: walk the mask with random allowed tokens
    until the grammar is complete; the tokenizer decodes a valid document."""
    tok = _sentencepiece_style_tokenizer()
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("</s>")
    compiler = GrammarCompiler(lambda: build_tokenizer(tok.to_str(), vocab, [eos]))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "n": SCHEMA["properties"]["n"]},
              "required": ["name", "n"], "additionalProperties": False}
    spec = GrammarSpec.json_schema(schema)
    batch = GrammarBatch(compiler, vocab)
    g = torch.Generator().manual_seed(0)
    for i in range(10):
        request = _request(f"r{i}", spec)
        batch.start(request)
        tokens: list[int] = []
        while not batch.finished(request.request_id) and len(tokens) < 40:
            allowed = unpack_bitmask(batch.mask([request]).bitmask, vocab)[0]
            choices = allowed.nonzero().flatten()
            token = int(choices[torch.randint(len(choices), (1,), generator=g)])
            if token == eos:
                break
            batch.accept(request.request_id, token)
            tokens.append(token)
        document = json.loads(tok.decode(tokens))
        jsonschema.validate(document, schema)
