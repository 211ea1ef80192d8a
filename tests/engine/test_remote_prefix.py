"""Cache-miss-only transfer and conditional disaggregation in the engine: a
decode engine with its prefix cache on holds the cached prefix of a
reservation (whole blocks), the prefill side's KV is injected only from
there, and the output equals the colocated engine's."""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.errors import CapacityError
from engine.sampling_params import SamplingParams
from tests.engine.test_remote import CaptureHook, _finish

pytestmark = pytest.mark.timeout(120)

PARAMS = SamplingParams(temperature=0.8, top_k=50, seed=5, max_tokens=8, ignore_eos=True)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(10, 1100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(make_engine, rid, prompt, params=PARAMS):
    """The prefill side: (first token, the hook holding every layer's KV)."""
    hook = CaptureHook()
    prefill = make_engine(block_size=16, max_num_batched_tokens=32, layer_kv_hook=hook)
    prefill.add_request(rid, prompt, params, prefill_only=True)
    outputs = []
    while prefill.has_unfinished_requests():
        outputs.extend(prefill.step())
    return outputs[-1].new_token_ids[0], hook


def _remote(make_engine, decode, rid, prompt, params=PARAMS):
    """One request through `decode` the P/D way; injects only the tokens the
    reservation does not hold. Returns (tokens, num_held_tokens)."""
    first, hook = _prefill(make_engine, rid, prompt, params)
    reservation = decode.reserve_remote(rid, prompt, params)
    held = reservation.num_held_tokens
    assert tuple(reservation.slot_mapping.shape) == (len(prompt) - held,)
    for layer, cache in enumerate(decode.kv_caches):
        kernels.inject_kv(cache, hook.layer(rid, layer)[:, held:].contiguous(),
                          reservation.slot_mapping)
    decode.commit_remote(rid, first)
    rest, _ = _finish(decode, rid)
    return [first, *rest], held


def _colocated(make_engine, prompt):
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request("c", prompt, PARAMS)
    return _finish(engine, "c")[0]


@pytest.mark.parametrize(("shared", "held"), [
    (40, 32),  # the shared prefix ends inside the third block: only two are held
    (32, 32),  # ... at the edge of the second block
    (48, 48),  # three whole blocks
], ids=["inside-a-block", "at-a-block-edge", "three-blocks"])
def test_held_prefix_is_not_injected_and_output_matches_colocated(make_engine, shared, held):
    common = _tokens(1, 48)
    first_prompt = common + _tokens(2, 10)  # 58 tokens: blocks 0..2 full and cached
    second = common[:shared] + _tokens(3, 21)
    assert second[shared] != first_prompt[shared]
    decode = make_engine(block_size=16, num_blocks=32)  # prefix cache on
    tokens, first_held = _remote(make_engine, decode, "a", first_prompt)
    assert first_held == 0 and tokens == _colocated(make_engine, first_prompt)
    tokens, second_held = _remote(make_engine, decode, "b", second)
    assert second_held == held
    assert tokens == _colocated(make_engine, second)
    assert decode.stats().num_free_blocks == 32


def test_a_prompt_that_is_all_cached_still_sends_its_last_token(make_engine):
    prompt = _tokens(4, 32)  # exactly two blocks
    decode = make_engine(block_size=16, num_blocks=32)
    _remote(make_engine, decode, "a", prompt)
    tokens, held = _remote(make_engine, decode, "b", prompt)
    assert held == 16  # the second block holds the last token, whose KV must arrive
    assert tokens == _colocated(make_engine, prompt)


def test_held_blocks_are_pinned_until_the_request_ends(make_engine):
    prompt = _tokens(5, 40)
    decode = make_engine(block_size=16, num_blocks=8)
    _remote(make_engine, decode, "a", prompt)
    reservation = decode.reserve_remote("b", prompt + [7, 8], SamplingParams(max_tokens=4))
    assert reservation.num_held_tokens == 32
    held_ids = reservation.block_ids[:2]
    assert all(decode.block_manager.pool.ref_count(b) == 1 for b in held_ids)
    assert decode.abort_request("b")
    assert all(decode.block_manager.pool.ref_count(b) == 0 for b in held_ids)
    assert decode.stats().num_free_blocks == 8


def test_a_refused_reservation_lets_go_of_its_held_blocks(make_engine):
    prompt = _tokens(6, 40)
    decode = make_engine(block_size=16, num_blocks=6, max_num_seqs=4)
    _remote(make_engine, decode, "a", prompt)  # caches 2 blocks (free, ref 0)
    decode.reserve_remote("x", _tokens(11, 32), SamplingParams(max_tokens=16))  # 3 uncached
    assert decode.stats().num_free_blocks == 3
    with pytest.raises(CapacityError, match="needs 4 KV blocks, 1 are free"):
        decode.reserve_remote("b", prompt + [9], SamplingParams(max_tokens=40))  # 6 blocks
    assert decode.stats().num_free_blocks == 3
    reservation = decode.reserve_remote("c", prompt + [9], SamplingParams(max_tokens=4))
    assert reservation.num_held_tokens == 32  # still cached


def test_no_prefix_cache_holds_nothing(make_engine):
    prompt = _tokens(7, 40)
    decode = make_engine(block_size=16, num_blocks=16, enable_prefix_caching=False)
    _remote(make_engine, decode, "a", prompt)
    assert _remote(make_engine, decode, "b", prompt)[1] == 0


def test_few_new_tokens_after_the_cached_prefix_are_computed_locally(make_engine):
    common = _tokens(8, 48)
    decode = make_engine(block_size=16, num_blocks=32)
    _remote(make_engine, decode, "a", common + _tokens(9, 4))
    prompt = common + _tokens(10, 11)  # 59 tokens, 48 cached: 11 new
    # 11 new tokens are not fewer than 11: reserved, 48 held
    reservation = decode.reserve_remote("b", prompt, PARAMS, local_prefill_below=11)
    assert reservation is not None and reservation.num_held_tokens == 48
    assert decode.abort_request("b")
    _finish(decode, "b")
    # fewer than 12: queued here and computed from the cached prefix on
    assert decode.reserve_remote("c", prompt, PARAMS, local_prefill_below=12) is None
    assert decode.stats().num_reserved == 0 and decode.has_unfinished_requests()
    outputs = []
    while decode.has_unfinished_requests():
        outputs.extend(o for o in decode.step() if o.request_id == "c")
    assert [t for o in outputs for t in o.new_token_ids] == _colocated(make_engine, prompt)
    assert outputs[0].num_cached_tokens == 48
