"""Disaggregated output equals the colocated pod's, token for token.

Same model, same seeds: prefill pod (block 16) + decode pod (block 128 over
TCP, block 256 over gRPC) driven the router's way, against the colocated pod.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from proto import pdserve_pb2
from tests.integration.flows import (
    colocated_generate,
    disaggregated_generate,
    prefill,
    wait_released,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Prompt lengths straddle the block boundaries of 16, 128 and 256 tokens and
# the prefill pod's 256-token chunk.
LENGTHS = (1, 15, 16, 17, 127, 129, 255, 257, 600)


def _sampling(i: int) -> pdserve_pb2.SamplingParams:
    if i % 2 == 0:
        return pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True)
    return pdserve_pb2.SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1000 + i,
                                      max_tokens=6 + i, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1100) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_concurrent_mixed_requests_match_colocated(transport, colocated_stub, prefill_stub,
                                                   decode_stubs, decode_pods, prefill_pod):
    prompts = _prompts(seed={"tcp": 1, "grpc": 2}[transport])
    jobs = list(enumerate(prompts))
    with ThreadPoolExecutor(len(jobs)) as pool:
        expected = list(pool.map(lambda j: colocated_generate(
            colocated_stub, f"col-{transport}-{j[0]}", j[1], _sampling(j[0])), jobs))
        got = list(pool.map(lambda j: disaggregated_generate(
            prefill_stub, decode_stubs[transport], f"dis-{transport}-{j[0]}", j[1],
            _sampling(j[0])), jobs))
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert len(want.token_ids) == 6 + i
        assert have.token_ids == want.token_ids, f"prompt {i} ({LENGTHS[i]} tokens)"
        assert have.finish_reason == want.finish_reason == "length"
    report = wait_released(decode_pods[transport], "Decode")
    assert report.num_free_blocks == report.num_total_blocks
    assert report.block_size == {"tcp": 128, "grpc": 256}[transport]


def test_prefix_cache_hit_on_the_prefill_pod(colocated_stub, prefill_stub, decode_stubs):
    rng = random.Random(7007)  # no other test draws this prefix
    system = [rng.randrange(5, 1100) for _ in range(70)]  # 4 full blocks of 16 + 6
    sampling = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    first = disaggregated_generate(prefill_stub, decode_stubs["tcp"], "prefix-a",
                                   system + [11, 12, 13], sampling)
    second = disaggregated_generate(prefill_stub, decode_stubs["tcp"], "prefix-b",
                                    system + [21, 22], sampling)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64  # the 4 full shared blocks
    for name, result, suffix in (("a", first, [11, 12, 13]), ("b", second, [21, 22])):
        want = colocated_generate(colocated_stub, f"prefix-col-{name}", system + suffix, sampling)
        assert result.token_ids == want.token_ids


@pytest.mark.parametrize("sampling", [
    pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    pdserve_pb2.SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=10,
                               ignore_eos=True),
], ids=["greedy", "seeded"])
def test_migrated_request_resumes_where_it_left_off(sampling, colocated_stub, prefill_stub,
                                                    decode_stubs):
    """output_token_ids are context and set the resume index (and the seeded RNG index)."""
    prompt = _prompts(seed=3)[5]  # 129 tokens
    full = colocated_generate(colocated_stub, f"mig-col-{sampling.seed}", prompt, sampling)
    resumed = disaggregated_generate(prefill_stub, decode_stubs["tcp"], f"mig-{sampling.seed}",
                                     prompt, sampling, output_token_ids=tuple(full.token_ids[:4]))
    assert resumed.token_ids == full.token_ids[4:]
    assert resumed.finish_reason == "length"


def test_colocated_pod_matches_the_engine_in_process(tiny_model_dir, colocated_stub):
    """The baseline itself: the colocated pod streams what LLMEngine.generate returns."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    prompts = _prompts(seed=4)[:4]
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), num_blocks=128))
    want = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=7,
                                                   ignore_eos=True))
    sampling = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    for i, (prompt, result) in enumerate(zip(prompts, want, strict=True)):
        got = colocated_generate(colocated_stub, f"engine-ref-{i}", prompt, sampling)
        assert got.token_ids == list(result.token_ids)


def test_logprobs_travel_with_the_first_token_and_the_stream(colocated_stub, prefill_stub,
                                                             decode_stubs):
    prompt = _prompts(seed=5)[6]  # 255 tokens
    sampling = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                          logprobs=3)
    colocated = [lp for message in colocated_stub.Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id="lp-col", prompt_token_ids=prompt, sampling=sampling), timeout=60)
        for lp in message.tokens.logprobs]
    call = decode_stubs["grpc"].Generate(pdserve_pb2.DecodeGenerateRequest(
        request_id="lp-dis", prompt_token_ids=prompt, sampling=sampling, remote_prefill=True),
        timeout=60)
    target = next(call).reserved.target
    first = prefill(prefill_stub, pdserve_pb2.PrefillRequest(
        request_id="lp-dis", prompt_token_ids=prompt, sampling=sampling, target=target),
        timeout=60).first_token.logprob
    disaggregated = [first, *(lp for message in call for lp in message.tokens.logprobs)]
    assert len(colocated) == len(disaggregated) == 4
    for want, got in zip(colocated, disaggregated, strict=True):
        assert got.token_id == want.token_id
        assert list(got.top_token_ids) == list(want.top_token_ids)
        assert len(got.top_token_ids) == 3
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert list(got.top_logprobs) == pytest.approx(list(want.top_logprobs), abs=1e-4)
