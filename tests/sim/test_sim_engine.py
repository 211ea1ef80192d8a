"""`SimEngine`: the real block pool and prefix cache under a modelled
forward: exact blocks held and freed, deterministic tokens, and the block
hashes of a computed prompt are the engine's hash function's."""

from __future__ import annotations

import pytest

from engine.errors import CapacityError
from engine.sampling_params import SamplingParams
from proto.block_hash import extend_block_hashes
from sim.engine import SimEngine, SimEngineConfig, token_at


def engine(num_blocks: int = 8, prefix: bool = True) -> SimEngine:
    return SimEngine(SimEngineConfig(vocab_size=1000, max_model_len=512, num_blocks=num_blocks,
                                     block_size=16, enable_prefix_caching=prefix))


def run(sim: SimEngine) -> list:
    outputs = []
    while sim.has_unfinished_requests():
        outputs += sim.finish_step(sim.plan_step())
    return outputs


def test_tokens_depend_on_seed_prompt_and_index_only():
    sim = engine()
    prompt = list(range(1, 40))
    sim.add_request("r", prompt, SamplingParams(max_tokens=5, seed=3))
    tokens = [t for o in run(sim) for t in o.new_token_ids]
    assert tokens == [token_at(3, prompt, i, 1000) for i in range(5)]
    assert token_at(3, prompt, 0, 1000) != token_at(4, prompt, 0, 1000)


def test_prefill_caches_the_engines_block_hashes_and_frees_its_blocks():
    sim = engine()
    stored: list[int] = []

    class Listener:
        def stored(self, block_hash: int) -> None:
            stored.append(block_hash)

        def evicted(self, block_hash: int) -> None:
            pass

    sim.block_manager.prefix_cache.set_listener(Listener())
    prompt = list(range(100, 140))  # 2 full blocks of 16
    sim.add_request("p", prompt, SamplingParams(max_tokens=1), prefill_only=True)
    (output,) = run(sim)
    assert output.finish_reason == "prefill_done"
    expected: list[int] = []
    extend_block_hashes(expected, prompt, 16)
    assert stored == expected
    assert sim.stats().num_free_blocks == 8  # cached blocks stay reusable, none held


def test_reserve_commit_and_abort_hold_and_free_exact_blocks():
    sim = engine()
    reservation = sim.reserve_remote("r", list(range(40)), SamplingParams(max_tokens=30))
    assert reservation is not None and len(reservation.block_ids) == 5  # 70 tokens / 16
    assert sim.stats().num_free_blocks == 3 and sim.stats().num_reserved == 1
    with pytest.raises(CapacityError, match="request needs 5 KV blocks, 3 are free"):
        sim.reserve_remote("s", list(range(40)), SamplingParams(max_tokens=30))
    sim.commit_remote("r", 7)
    plan = sim.plan_step()
    assert sim.abort_request("r")  # while its step is in flight
    assert sim.stats().num_free_blocks == 3  # deferred until the step completes
    outputs = sim.finish_step(plan)
    assert [o.finish_reason for o in outputs] == ["abort"]
    assert sim.stats().num_free_blocks == 8


def test_what_is_not_simulated_is_refused_by_name():
    with pytest.raises(ValueError, match="logprobs and prompt_logprobs are not simulated"):
        engine().add_request("r", [1, 2], SamplingParams(max_tokens=2, logprobs=1))
