"""The within-budget local rule (engine/local_rule.py): a decode engine that
caches more of a next turn than the prefill pod (the previous turn's
answer, which it generated) computes the rest itself when that fits its
inter-token budget, with the held history as cache hits, and the output
equals the colocated engine's. Every condition of the rule is checked to
send the request back to the P/D path when it fails."""

from __future__ import annotations

import pytest

from engine.local_rule import LocalAsk
from engine.sampling_params import SamplingParams
from tests.engine.test_remote import _finish
from tests.engine.test_remote_prefix import _colocated, _remote, _tokens

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
PARAMS = SamplingParams(temperature=0.8, top_k=50, seed=5, max_tokens=8, ignore_eos=True)
ANSWER = SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=16, ignore_eos=True)
PROMPT = 36  # turn one: 2 whole blocks; its 16-token answer completes the third


def _decode(make_engine, **overrides):
    fields = {"block_size": BLOCK, "num_blocks": 32, "itl_budget": "auto",
              "mixed_prefill_tokens": 64}
    fields.update(overrides)
    return make_engine(**fields)


def _first_turn(make_engine, decode) -> list[int]:
    """Turn one the P/D way (the prompt's KV injected, the answer generated
    here); returns the next turn's prompt: the history plus 7 new tokens,
    whose first 48 tokens the decode engine caches (32 received, 16 computed): 11 new."""
    prompt = _tokens(20, PROMPT)
    tokens, _ = _remote(make_engine, decode, "turn1", prompt, ANSWER)
    return prompt + tokens + _tokens(21, 7)


def _run(decode, rid):
    outputs = []
    while decode.has_unfinished_requests():
        outputs.extend(o for o in decode.step() if o.request_id == rid)
    return [t for o in outputs for t in o.new_token_ids], outputs[0].num_cached_tokens


def test_a_next_turn_whose_history_the_pod_holds_is_computed_here(make_engine):
    decode = _decode(make_engine)
    prompt = _first_turn(make_engine, decode)
    assert len(prompt) == 59
    # the prefill pod caches turn one's 2 whole blocks; this pod 3 (the answer's too)
    assert decode.reserve_remote("t2", prompt, PARAMS, prefill_cached_tokens=32) is None
    assert decode.stats().num_reserved == 0
    tokens, cached = _run(decode, "t2")
    assert cached == 48  # the answer's block is a hit, not computed again
    assert tokens == _colocated(make_engine, prompt)


@pytest.mark.parametrize("prefill_cached", [48, 56])
def test_nothing_more_than_the_prefill_pod_caches_reserves(make_engine, prefill_cached):
    decode = _decode(make_engine)
    prompt = _first_turn(make_engine, decode)
    reservation = decode.reserve_remote("t2", prompt, PARAMS,
                                        prefill_cached_tokens=prefill_cached)
    assert reservation is not None and reservation.num_held_tokens == 48


def test_without_the_rule_or_a_budget_it_reserves(make_engine):
    decode = _decode(make_engine)
    prompt = _first_turn(make_engine, decode)
    assert decode.reserve_remote("a", prompt, PARAMS).num_held_tokens == 48  # rule not asked
    assert decode.abort_request("a")
    _finish(decode, "a")
    off = _decode(make_engine, itl_budget="off")
    prompt = _first_turn(make_engine, off)
    reservation = off.reserve_remote("b", prompt, PARAMS, prefill_cached_tokens=0)
    assert reservation is not None and reservation.num_held_tokens == 48


def test_more_new_tokens_than_a_chunk_reserve_while_the_model_learns(make_engine):
    decode = _decode(make_engine, mixed_prefill_tokens=6)  # 11 new tokens > 6
    prompt = _first_turn(make_engine, decode)
    assert decode.reserve_remote("t2", prompt, PARAMS, prefill_cached_tokens=0) is not None


def test_prompt_work_already_queued_reserves(make_engine):
    decode = _decode(make_engine)
    prompt = _first_turn(make_engine, decode)
    decode.add_request("other", _tokens(22, 20), PARAMS)  # waits to be computed here
    assert decode.reserve_remote("t2", prompt, PARAMS, prefill_cached_tokens=0) is not None


def _learnt(decode, budget_ms: float) -> None:
    """A learnt step-time model (seconds): 10 ms a step + 1 ms a row + 0.1 ms
    a token; turn one's last step decoded one row, which it predicts at 11.1 ms."""
    budget = decode.scheduler.itl_budget
    assert budget.last_decoding is not None and budget.last_decoding.rows == 1
    budget.model.coefficients = (0.010, 0.001, 0.0001, 0.0)
    budget.budget_ms = budget_ms


def _reserves(decode, rid, prompt, prefill_cached) -> bool:
    """Whether the pod reserves for `prompt` (else it queued it to compute);
    the request is aborted either way, with no step, so the next ask finds
    the pod as before (the last step's decoding row included)."""
    reservation = decode.reserve_remote(rid, prompt, PARAMS, prefill_cached_tokens=prefill_cached)
    assert decode.abort_request(rid)
    assert not decode.scheduler.waiting and not decode.scheduler.reserved
    return reservation is not None


def test_new_tokens_with_no_room_in_the_budget_reserve(make_engine):
    decode = _decode(make_engine, itl_budget="12")
    prompt = _first_turn(make_engine, decode)
    _learnt(decode, 12.0)  # a row of n tokens beside the batch: 11.1 + 1 + 0.1 n > 12
    assert _reserves(decode, "t2", prompt, 0)


def test_new_tokens_that_fit_the_next_step_are_computed_here(make_engine):
    decode = _decode(make_engine, itl_budget="30")
    prompt = _first_turn(make_engine, decode)  # 59 tokens, 48 cached here: 11 new
    # room beside the last step's decoding row: (budget - 11.1 - 1) / 0.1 tokens
    _learnt(decode, 30.0)  # 179
    assert not _reserves(decode, "t2", prompt, 0)
    decode.scheduler.itl_budget.budget_ms = 12.5  # 4
    assert _reserves(decode, "t3", prompt, 0)


def test_an_idle_pod_counts_a_stream_that_may_join(make_engine):
    """Its step is not capped, so the rule keeps room for one decoding row."""
    decode = _decode(make_engine, itl_budget="12.5")
    prompt = _first_turn(make_engine, decode)
    _learnt(decode, 12.5)
    decode.add_request("gone", _tokens(23, 4), PARAMS)
    assert decode.abort_request("gone")
    _finish(decode, "gone")  # a step that decodes nothing
    assert decode.scheduler.itl_budget.last_decoding is None
    assert _reserves(decode, "t2", prompt, 0)  # room beside one row: 4 tokens
    decode.scheduler.itl_budget.budget_ms = 30.0
    assert not _reserves(decode, "t3", prompt, 0)


@pytest.mark.parametrize(("below", "beyond", "message"), [
    (-1, None, "local_prefill_below must be >= 0, got -1"),
    (0, -2, "prefill_cached_tokens must be >= 0, got -2"),
])
def test_negative_asks_are_named(below, beyond, message):
    with pytest.raises(ValueError, match=message):
        LocalAsk(below, beyond)
