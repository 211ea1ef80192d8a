"""`n > 1` shares the prompt's KV only through the prefill pod's prefix
cache (router/http/choices.py, docs/router.md "n > 1"): real pods, a real
router under the default routing policy, the official `openai` client.

Two prefill pods (the session's and one started here, same flags: block
16, prefix cache on) and one decode pod behind a router with no
`--routing-policy` flag. Choice 0 of an `n = 3` request misses the cache
and fills it; choices 1 and 2 start after its first token, are routed by
the same prompt to the same prefill pod, and find every full block of the
prompt there. The pods' `pdserve_prefix_cache_{queries,hits}_total`
counters say so exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import openai
import pytest

from tests.integration.conftest import POD_SPECS
from tests.integration.pods import PodProcess, start_pod
from tests.router.router_process import RouterProcess, start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK_SIZE = POD_SPECS["prefill"][1]["block_size"]
PROMPT_LEN = 3 * BLOCK_SIZE + 2  # 3 full blocks to look up (the last token is always computed)


@pytest.fixture(scope="module")
def prefill_pods(tiny_model_dir, prefill_pod) -> Iterator[list[PodProcess]]:
    other = start_pod("prefill", tiny_model_dir, **POD_SPECS["prefill"][1])
    try:
        yield [prefill_pod, other]
    finally:
        other.kill()


@pytest.fixture(scope="module")
def router(tiny_model_dir, prefill_pods, decode_pods) -> Iterator[RouterProcess]:
    started = start_router(tiny_model_dir, prefill=[pod.address for pod in prefill_pods],
                           decode=[decode_pods["tcp"].address])
    try:
        wait_ready(started)
        yield started
    finally:
        started.terminate()


def _cache_counters(pod: PodProcess) -> tuple[float, float]:
    return (pod.metric_value("pdserve_prefix_cache_queries_total"),
            pod.metric_value("pdserve_prefix_cache_hits_total"))


def test_later_choices_hit_the_prefill_pods_prefix_cache(router, prefill_pods):
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0,
                           timeout=120)
    # ids no other test sends, so no pod has cached them
    prompt = random.Random(0x5EED_C401CE).choices(range(100, 1000), k=PROMPT_LEN)
    before = [_cache_counters(pod) for pod in prefill_pods]
    three = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=4,
                                      temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage.completion_tokens == 12
    assert three.usage.prompt_tokens_details.cached_tokens == 0  # choice 0's: it missed
    after = [_cache_counters(pod) for pod in prefill_pods]
    deltas = sorted((a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True))
    # one pod took all three choices: 3 x 3 blocks looked up, choices 1 and 2
    # found all 3; the other pod saw nothing
    assert deltas == [(0.0, 0.0), (9.0, 6.0)]
