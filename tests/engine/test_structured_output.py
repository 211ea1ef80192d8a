"""Structured outputs in the engine: the random-weight tiny model, left
alone, emits garbage; under a grammar every output follows it, the request
stops when the grammar is complete, and the paths (sync / async
scheduling, prefill pod + decode pod) give the same tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

import kernels
from engine.grammar import GrammarKind, GrammarSpec
from engine.sampling_params import SamplingParams
from tests.engine.test_remote import CaptureHook, _finish

pytestmark = pytest.mark.timeout(180)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tag", "ok"],
    "additionalProperties": False,
}
SPEC = GrammarSpec.json_schema(SCHEMA)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1100, (int(torch.randint(3, 20, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def _params(seed: int, grammar: GrammarSpec | None = SPEC, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 48,
                             "grammar": grammar, **kw})


def test_json_schema_outputs_parse_and_validate(make_engine):
    engine = make_engine()
    results = engine.generate(_prompts(12), [_params(s) for s in range(12)])
    for r in results:
        assert r.finish_reason == "stop", r.text  # the grammar completed: stopped there
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.token_ids[-1] not in engine.eos_token_ids  # stopped on the last '}'


def test_without_grammar_the_model_emits_garbage_and_mixed_batches_keep_it(make_engine):
    """Rows without grammar are untouched by the grammar rows beside them."""
    prompts = _prompts(6, seed=1)
    free = [_params(s, grammar=None, ignore_eos=True, max_tokens=12) for s in range(6)]
    alone = make_engine().generate(prompts, free)
    assert not any(r.text.startswith("{") for r in alone)
    mixed = make_engine().generate(prompts + prompts, free + [_params(s) for s in range(6)])
    assert [r.token_ids for r in mixed[:6]] == [r.token_ids for r in alone]
    for r in mixed[6:]:
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_async_scheduling_gives_the_same_tokens(make_engine):
    prompts = _prompts(8, seed=2)
    params = [_params(s, grammar=SPEC if s % 2 else None, ignore_eos=True) for s in range(8)]
    sync = make_engine(async_scheduling=False).generate(prompts, params)
    async_ = make_engine(async_scheduling=True).generate(prompts, params)
    assert [r.token_ids for r in async_] == [r.token_ids for r in sync]
    assert [r.finish_reason for r in async_] == [r.finish_reason for r in sync]


@pytest.mark.parametrize(("spec", "pattern"), [
    (GrammarSpec(GrammarKind.REGEX, r"(cat|dog)-[0-9]{2,3}"), r"(cat|dog)-[0-9]{2,3}"),
    (GrammarSpec(GrammarKind.GRAMMAR, 'start: "say " word\nword: "yes" | "no"'), r"say (yes|no)"),
    (GrammarSpec(GrammarKind.GRAMMAR, 'root ::= "x" [0-9] [0-9]'), r"x[0-9][0-9]"),  # GBNF
], ids=["regex", "lark", "gbnf"])
def test_regex_and_grammars(make_engine, spec, pattern):
    results = make_engine().generate(_prompts(4, seed=3), [_params(s, spec) for s in range(4)])
    for r in results:
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text


def test_eos_only_where_the_grammar_accepts(make_engine):
    """'a+' accepts after one 'a' but never finishes: each request stops on
    eos or max_tokens, with only 'a's before it."""
    spec = GrammarSpec(GrammarKind.REGEX, "a+")
    engine = make_engine()
    results = engine.generate(_prompts(6, seed=4), [_params(s, spec, max_tokens=24)
                                                    for s in range(6)])
    for r in results:
        assert re.fullmatch("a+", r.text), r.text
        stopped_on_eos = r.token_ids[-1] in engine.eos_token_ids
        assert (r.finish_reason, stopped_on_eos) in (("stop", True), ("length", False))


def _prefill_then_decode(make_engine, prompt, params, output_token_ids=()):
    """The prefill pod samples the first token (under the grammar); the decode
    pod reserves, gets the KV, commits that token and continues."""
    hook = CaptureHook()
    prefill = make_engine(block_size=16, layer_kv_hook=hook)
    prefill.add_request("q", prompt, params, output_token_ids=output_token_ids,
                        prefill_only=True)
    (first,), _ = _finish(prefill, "q")
    decode = make_engine(block_size=128, num_blocks=8, enable_prefix_caching=False)
    reservation = decode.reserve_remote("q", prompt, params, output_token_ids=output_token_ids)
    for layer, cache in enumerate(decode.kv_caches):
        kernels.inject_kv(cache, hook.layer("q", layer), reservation.slot_mapping)
    decode.commit_remote("q", first)
    rest, reason = _finish(decode, "q")
    assert decode.stats().num_free_blocks == 8 and len(decode.grammars) == 0
    return [first, *rest], reason


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_disaggregated_equals_colocated(make_engine, seed):
    prompt = _prompts(1, seed=10 + seed)[0]
    params = _params(seed)
    colocated = make_engine()
    colocated.add_request("q", prompt, params)
    expected = _finish(colocated, "q")
    assert expected[1] == "stop"
    assert _prefill_then_decode(make_engine, prompt, params) == expected
    # A migration after 3 tokens: both pods advance the grammar over them first.
    tokens = expected[0]
    resumed = _prefill_then_decode(make_engine, prompt, params, output_token_ids=tokens[:3])
    assert resumed == (tokens[3:], "stop")


def test_commit_of_a_token_outside_the_grammar_is_refused(make_engine, tiny_model_dir):
    engine = make_engine(block_size=128, num_blocks=8, enable_prefix_caching=False)
    engine.reserve_remote("q", [5, 6, 7], _params(0))
    with pytest.raises(ValueError, match="does not follow"):
        engine.commit_remote("q", 200)  # not '{'
    assert engine.abort_request("q") and len(engine.grammars) == 0
