"""Faults on cache-miss-only transfers: a decode pod at its default (its
prefix cache on) holds a conversation's first turn, so the next turn's
transfer carries only the tokens past it; the link drops or corrupts that
transfer (issue 42: the failure paths once more with miss-only transfers).

Real processes on loopback: a prefill pod, a decode pod that advertises
127.0.0.2 for its KV port where a `FaultProxy` listens (as in the package's
stack, conftest.py), a router in front (whole-prompt path: no split, no
local prefill, two moves). Each test sends its own first turn (fresh tokens,
so nothing else's cache answers for it), then a next turn with a fault on
the KV link. What must hold: the fault was met, the transfers were
miss-only (the decode pod's saved-bytes counter grows), the output equals the
in-process engine's for the same tokens, and the decode pod's cached
blocks are not spoiled: the same next turn again, undisturbed, is exact.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.faults.client import Outcome, generate
from tests.faults.conftest import KV_HOST, RESERVATION_TIMEOUT_S, TRANSFER_TIMEOUT_S
from tests.faults.proxy import Fault, FaultProxy
from tests.faults.stack import assert_pods_at_baseline, usage
from tests.integration.pods import PodProcess, start_pods
from tests.router.router_process import RouterProcess, start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 8
FIRST, NEXT = 320, 200  # tokens of the first turn, and new tokens of the next
STREAMS = 2


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[tuple[RouterProcess, dict[str, PodProcess],
                                              FaultProxy]]:
    pods = start_pods({
        "prefill": ("prefill", {"block_size": 16, "num_blocks": 256,
                                "max_num_batched_tokens": 64, "kv_streams": STREAMS}),
        # no prefix-cache flag: the decode pod's default keeps one
        "decode": ("decode", {"block_size": 16, "num_blocks": 256, "advertise_host": KV_HOST,
                              "transfer_timeout": TRANSFER_TIMEOUT_S,
                              "reservation_timeout": RESERVATION_TIMEOUT_S,
                              "landing_memory": "16MiB"}),
    }, tiny_model_dir)
    decode = pods["decode"]
    kv = FaultProxy((KV_HOST, decode.kv_port), ("127.0.0.1", decode.kv_port)).start()
    router = start_router(tiny_model_dir, prefill=[pods["prefill"].address],
                          decode=[decode.address], request_timeout=20.0, max_migrations=2,
                          split_prefill_min_tokens=0, local_prefill_max_tokens=0)
    try:
        wait_ready(router)
        yield router, pods, kv
    finally:
        router.terminate()
        kv.close()
        for pod in pods.values():
            pod.kill()


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), dtype="float32",
                                  device="cpu", num_blocks=256))


def _expected(engine: LLMEngine, prompt: list[int]) -> list[int]:
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True))[0]
    return list(result.token_ids)


def _generate(router: RouterProcess, prompt: list[int]) -> Outcome:
    return generate(router.grpc_address, prompt, MAX_TOKENS, timeout=30)


def _turns(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    first = [rng.randrange(5, 1100) for _ in range(FIRST)]
    return first, first + [rng.randrange(5, 1100) for _ in range(NEXT)]


def _saved(decode: PodProcess) -> float:
    try:
        return decode.metric_value("pdserve_kv_transfer_saved_bytes_total")
    except KeyError:
        return 0.0


@pytest.mark.parametrize(("seed", "fault"), [
    (1, Fault(drop_after_bytes=40_000)),
    (2, Fault(truncate_after_bytes=40_000)),
    (3, Fault(corrupt_at_byte=30_000)),
], ids=["drop", "truncate", "corrupt-kv"])
def test_a_fault_on_a_miss_only_transfer_keeps_the_output_exact_and_the_cache_clean(
        cluster, engine, seed, fault):
    router, pods, kv = cluster
    decode = pods["decode"]
    first, turn = _turns(seed)
    got = _generate(router, first)
    assert got.error is None, got.describe()
    assert got.tokens == _expected(engine, first)
    baseline = {name: usage(pod.process.pid) for name, pod in pods.items()}
    saved, triggered = _saved(decode), kv.triggered
    migrations = router.metric("pdserve_migrations_total")
    kv.set_fault(fault, connections=STREAMS)
    kv.reset_all()  # the prefill pod's pooled streams reopen through the fault
    try:
        faulted = _generate(router, turn)
    finally:
        kv.heal()
    expected = _expected(engine, turn)
    assert kv.triggered > triggered, "the fault never met the transfer"
    # A lost or corrupted transfer moves the request (the decode pod, the only
    # one, stays a candidate and the retry's clean transfer serves it), or,
    # when the decode side reports the refusal first, fails it clearly;
    # either way no spoiled KV reaches a token.
    if faulted.error is not None:
        assert faulted.error.code().name == "UNAVAILABLE", faulted.describe()
        assert faulted.tokens == expected[:len(faulted.tokens)]
    else:
        assert faulted.tokens == expected
        assert router.metric("pdserve_migrations_total") > migrations
    # the blocks the decode pod keeps for this conversation are sound
    again = _generate(router, turn)
    assert again.error is None, again.describe()
    assert again.tokens == expected
    # the decode pod counts a transfer's saved bytes when it completes: the
    # retry's or this one's (a refused transfer counts none)
    assert _saved(decode) > saved, "the next turn's transfers were not miss-only"
    assert_pods_at_baseline(pods, baseline)
