"""The router's prefix index: batches applied (snapshot, incremental,
duplicates, gaps), a restart (new generation) clearing a pod, the memory
bound, and the router-side prompt hash equal to the engine's own block hashes
for the same tokens (a real engine with its prefix cache)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from proto.block_hash import extend_block_hashes, hash_block_tokens
from router.cache_index.index import PrefixIndex, PromptBlocks

POD = "127.0.0.1:6001"


def batch(sequence: int, stored=(), evicted=(), *, generation: int = 7, snapshot=False,
          block_size: int = 4, address: str = POD) -> pdserve_pb2.CacheEventBatch:
    return pdserve_pb2.CacheEventBatch(
        address=address, role="prefill", generation=generation, block_size=block_size,
        sequence=sequence, snapshot=snapshot, stored=list(stored), evicted=list(evicted))


def chain(tokens: list[int], block_size: int = 4) -> list[int]:
    hashes: list[int] = []
    for i in range(len(tokens) // block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                        tokens[i * block_size:(i + 1) * block_size]))
    return hashes


def test_prompt_hashes_leave_the_last_token_to_compute():
    tokens = list(range(1, 13))  # 12 tokens = 3 full blocks of 4
    prompt = PromptBlocks(tokens)
    assert prompt.hashes(4) == chain(tokens)[:2]  # the block of the last token is computed
    assert PromptBlocks(tokens + [99]).hashes(4) == chain(tokens)
    assert prompt.hashes(8) == chain(tokens, 8)[:1]  # per block size, memoized
    assert prompt.hashes(12) == []  # 11 reusable tokens: no full block of 12
    assert PromptBlocks(tokens[:4]).hashes(4) == []


def test_batches_build_the_set_and_lookups_count_leading_blocks():
    index = PrefixIndex()
    tokens = list(range(1, 18))
    h = chain(tokens)
    index.apply(batch(1, stored=h[:2]))
    assert index.cached_tokens(POD, PromptBlocks(tokens)) == 8
    index.apply(batch(2, stored=h[2:4]))
    assert index.cached_tokens(POD, PromptBlocks(tokens)) == 16
    index.apply(batch(3, evicted=[h[1]]))
    assert index.cached_tokens(POD, PromptBlocks(tokens)) == 4  # a hole ends the prefix
    index.apply(batch(2, stored=[h[1]]))  # an old batch again: ignored
    assert index.cached_tokens(POD, PromptBlocks(tokens)) == 4
    assert index.cached_prefix(POD, tokens) == 4
    assert index.cached_prefix("127.0.0.1:6002", tokens) == 0  # never heard from
    assert index.missed_batches == 0
    index.apply(batch(6, stored=[h[1]]))  # batches 4 and 5 were missed
    assert index.missed_batches == 2 and index.cached_tokens(POD, PromptBlocks(tokens)) == 16


def test_snapshot_replaces_and_new_generation_clears():
    index = PrefixIndex()
    h = chain(list(range(1, 18)))
    index.apply(batch(1, stored=h))
    index.apply(batch(9, stored=h[:1], snapshot=True))
    assert index.num_blocks(POD) == 1
    index.apply(batch(10, stored=h[1:2]))
    assert index.num_blocks(POD) == 2
    # the pod restarted: its first batch (numbering starts over) voids the old entries
    index.apply(batch(1, stored=h[3:4], generation=8))
    assert index.num_blocks(POD) == 1 and index.restarts == 1
    # a poll seeing yet another generation clears before any batch of it arrives
    index.observe_generation(POD, 9)
    assert index.num_blocks(POD) == 0 and index.restarts == 2
    index.observe_generation(POD, 9)  # unknown pod now: nothing to do
    index.apply(batch(1, stored=h[:2], generation=9))
    index.forget(POD)
    assert index.addresses() == [] and index.num_blocks() == 0


def test_memory_bound_drops_the_oldest_stored():
    index = PrefixIndex(max_blocks_per_pod=3)
    index.apply(batch(1, stored=[1, 2, 3]))
    index.apply(batch(2, stored=[1, 4]))  # 1 re-stored: now the youngest
    assert index.num_blocks(POD) == 3
    index.apply(batch(3, stored=[5]))
    assert set(index._pods[POD].hashes) == {1, 4, 5}
    with pytest.raises(ValueError, match="cache index blocks per pod must be in"):
        PrefixIndex(max_blocks_per_pod=0)


@pytest.mark.parametrize("block_size", [16, 32])
def test_router_hash_equals_the_engines_for_the_same_tokens(tiny_model_dir, block_size):
    """The engine's prefix cache stores exactly the hashes the router computes
    for the prompt + generated tokens it sends, under the pod's block size."""
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), dtype="float32",
                                    num_blocks=64, block_size=block_size,
                                    enable_prefix_caching=True))
    stored: list[int] = []

    class Listener:
        def stored(self, block_hash: int) -> None:
            stored.append(block_hash)

        def evicted(self, block_hash: int) -> None:
            raise AssertionError("nothing is evicted here")

    engine.block_manager.prefix_cache.set_listener(Listener())
    prompt = [(i * 37) % 200 + 3 for i in range(3 * block_size + 2)]
    (result,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3,
                                                         ignore_eos=True))
    context = prompt + list(result.token_ids)
    # the engine cached every full block of the context it computed
    full = PromptBlocks(context + [0]).hashes(block_size)
    assert stored[:len(full)] == full and len(full) >= 3
    index = PrefixIndex()
    index.apply(batch(1, stored=stored, block_size=block_size))
    # a later request for the same prompt: every reusable block is known cached
    assert index.cached_prefix(POD, prompt) == (len(prompt) - 1) // block_size * block_size
    # and the engine agrees: it finds exactly that prefix in its cache
    engine.add_request("again", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    (out,) = [o for o in engine.step() if o.request_id == "again"]
    assert out.num_cached_tokens == index.cached_prefix(POD, prompt)


@pytest.mark.parametrize("length", [0, 15, 16, 17, 100, 1000])
def test_batched_hashing_equals_block_by_block(length):
    """`extend_block_hashes` packs many blocks at once; the result is the
    chain of `hash_block_tokens`, also when extended in two steps."""
    import random

    rng = random.Random(length)
    tokens = [rng.randrange(-5, 1 << 40) for _ in range(length)]
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens[:length // 2], 16)
    extend_block_hashes(hashes, tokens, 16)
    assert hashes == chain(tokens, 16)


def test_an_expected_prompt_counts_until_its_pod_says_otherwise():
    index = PrefixIndex(max_blocks_per_pod=3)
    tokens = list(range(1, 18))  # 4 reusable blocks of 4
    h = chain(tokens)
    index.expect(POD, PromptBlocks(tokens))  # never heard from: nothing to go on
    assert index.cached_tokens(POD, PromptBlocks(tokens)) == 0
    index.apply(batch(1))
    index.expect(POD, PromptBlocks(tokens))
    assert index.num_blocks(POD) == 3  # the bound holds: the oldest (first) block went
    assert index.cached_tokens(POD, PromptBlocks(tokens)) == 0
    index.apply(batch(2, evicted=h[1:]))
    assert index.num_blocks(POD) == 0
    short = tokens[:9]  # 2 reusable blocks
    index.expect(POD, PromptBlocks(short))
    assert index.cached_tokens(POD, PromptBlocks(tokens)) == 8  # a follow-up finds them
    index.apply(batch(3, evicted=[h[0]]))  # the pod did not keep the first
    assert index.cached_tokens(POD, PromptBlocks(tokens)) == 0


@pytest.mark.parametrize("seed", range(4))
def test_published_names_exactly_the_pods_holding_a_block(seed):
    """`published()` (what the decode choice asks before it ranks by cached
    prefix) is kept as blocks come and go; checked against counting every
    pod's blocks after each random change."""
    import random

    rng = random.Random(seed)
    index = PrefixIndex(max_blocks_per_pod=6)
    pods = [f"127.0.0.1:{6001 + i}" for i in range(4)]
    sequences = dict.fromkeys(pods, 0)
    generations = dict.fromkeys(pods, 1)
    for _ in range(300):
        pod = rng.choice(pods)
        action = rng.random()
        hashes = [rng.randrange(12) for _ in range(rng.randrange(4))]
        if action < 0.5:
            sequences[pod] += 1
            snapshot = rng.random() < 0.2
            index.apply(batch(sequences[pod], stored=hashes if rng.random() < 0.6 else (),
                              evicted=() if snapshot else hashes, snapshot=snapshot,
                              generation=generations[pod], address=pod))
        elif action < 0.65:
            generations[pod] += 1
            sequences[pod] = 0
            index.apply(batch(0, generation=generations[pod], address=pod))
        elif action < 0.8:
            index.expect(pod, PromptBlocks(list(range(rng.randrange(0, 20)))))
        elif action < 0.9:
            generations[pod] += 1
            index.observe_generation(pod, generations[pod])
        else:
            index.forget(pod)
        assert set(index.published()) == {a for a in index.addresses() if index.num_blocks(a)}


@pytest.mark.parametrize("seed", range(3))
def test_holders_are_the_pods_with_a_cached_prefix_and_their_tokens(seed):
    """`holders(prompt)` against asking every pod: the pods whose cached
    prefix of the prompt is not empty, with that prefix, at two block sizes."""
    import random

    rng = random.Random(seed)
    index = PrefixIndex()
    tokens = [rng.randrange(50) for _ in range(40)]
    pods = [f"127.0.0.1:{6001 + i}" for i in range(12)]
    for i, pod in enumerate(pods):
        size = 4 if i % 3 else 8
        full = chain(tokens, size)
        held = full[:rng.randrange(len(full) + 1)] if rng.random() < 0.6 else []
        if rng.random() < 0.3:
            held = full[1:]  # later blocks without the first: nothing to reuse
        noise = [rng.getrandbits(64) for _ in range(rng.randrange(3))]
        index.apply(batch(1, stored=held + noise, snapshot=True, block_size=size,
                          address=pod))
    for prompt in (PromptBlocks(tokens), PromptBlocks(tokens[:9]), PromptBlocks(tokens[:3])):
        expected = {pod: index.cached_tokens(pod, prompt) for pod in pods}
        assert index.holders(prompt) == {p: n for p, n in expected.items() if n}
