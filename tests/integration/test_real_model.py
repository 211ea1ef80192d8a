"""SmolLM2-135M-Instruct (real trained weights) through every path, end to
end: real prefill, decode and colocated pods, real `pdserve router`
processes, the openai client.

Per dtype (float32, bfloat16), four routers over the same pods:
disaggregated only (idle side and split off), colocated, local prefill on
the decode pod (conditional disaggregation: every prompt below the
threshold), and split prefill (the prefill pod computes a head, the decode
pod the tail). Every path's text equals the colocated pod's, greedy and
seeded; the chat endpoint answers the capital of France with Paris and
stops at the model's <|im_end|>; a second turn through a decode pod with
its prefix cache on is sent only its cache miss.

The colocated pod's chat answers are computed once per dtype and sampling
(the same question every test asks) and completions are 16 tokens: the
point is equality, and 16 decode steps cross every path's hand-off as 24
did, at two thirds of the CPU time. Seeded sampling completes only the long
prompt (`PROMPTS_BY_SAMPLING`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from tests.integration.pods import PodProcess, start_pods
from tests.router.router_process import RouterProcess, start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
# The question every chat test asks. Not the bare "What is the capital of
# France?": there the first token's two best logits ("The", "L") are 0.08
# apart in float32, closer than bfloat16 arithmetic resolves, and on a CPU
# with AVX512-BF16 the bfloat16 pods began "L'Étoile, ..." (transformers in
# bfloat16 kept "The"). With "Answer in one sentence." the margin is ~1.5 in
# both dtypes, so the answer naming Paris tests the weights, not the rounding.
QUESTION = [{"role": "user",
             "content": "What is the capital of France? Answer in one sentence."}]
LONG = ("The printing press, developed by Johannes Gutenberg around 1440, changed how "
        "knowledge moved through Europe. Before it, books were copied by hand, slowly and at "
        "great cost. ") * 12
PROMPTS = ["Once upon a time, in a small village by the sea,",
           "def quicksort(items):\n    ",
           "Summarize in one sentence: " + LONG]
# greedy, then seeded sampling: both must match across paths
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}]
# Which prompts each sampling completes: every prompt greedy, and seeded only
# the long one, the one that crosses a 128-token decode block and is split on
# the split path (sampling's equality rests on the same seeded generator
# whatever the prompt, so more seeded prompts add CPU, not coverage).
PROMPTS_BY_SAMPLING = [PROMPTS, PROMPTS[-1:]]


@dataclass
class Deployment:
    pods: dict[str, PodProcess]
    routers: dict[str, RouterProcess]
    colocated_chats: dict[str, tuple[str, str]]

    def client(self, path: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.routers[path].base_url, api_key="-",
                             max_retries=0, timeout=300)

    def colocated_chat(self, **sampling) -> tuple[str, str]:
        """The colocated pod's answer to QUESTION, asked once per sampling:
        the pod is deterministic (greedy, or seeded), so asking again would
        only spend CPU."""
        key = repr(sorted(sampling.items()))
        if key not in self.colocated_chats:
            self.colocated_chats[key] = _chat(self.client("colocated"), QUESTION, **sampling)
        return self.colocated_chats[key]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def deployment(request, smollm2_model_dir) -> Iterator[Deployment]:
    dtype = request.param
    pods = start_pods({
        "prefill": ("prefill", {"block_size": 16, "num_blocks": 512, "dtype": dtype}),
        "decode": ("decode", {"block_size": 128, "num_blocks": 64, "dtype": dtype,
                              "prefix_cache": True}),
        "colocated": ("colocated", {"block_size": 128, "num_blocks": 64, "dtype": dtype}),
    }, smollm2_model_dir)
    pair = {"prefill": [pods["prefill"].address], "decode": [pods["decode"].address]}
    flags = {
        "disaggregated": {**pair, "local_prefill_max_tokens": 0, "split_prefill_min_tokens": 0},
        "colocated": {"colocated": [pods["colocated"].address]},
        "local": {**pair, "local_prefill_max_tokens": 0, "split_prefill_min_tokens": 0,
                  "local_prefill_below": 100_000},
        "split": {**pair, "local_prefill_max_tokens": 0, "split_prefill_min_tokens": 64},
    }
    routers: dict[str, RouterProcess] = {}
    try:
        for path, router_flags in flags.items():
            routers[path] = start_router(smollm2_model_dir, served_model_name=MODEL,
                                         **router_flags)
        for router in routers.values():
            wait_ready(router)
        yield Deployment(pods, routers, {})
    finally:
        for router in routers.values():
            router.terminate()
        for pod in pods.values():
            pod.terminate()


def _chat(client: openai.OpenAI, messages: list[dict], **sampling) -> tuple[str, str]:
    """Streamed chat: (text, finish_reason)."""
    text, reason = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48,
                                                stream=True, **sampling):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


def _complete(client: openai.OpenAI, prompt: str, **sampling) -> str:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                      extra_body={"ignore_eos": True}, **sampling)
    return reply.choices[0].text


def test_the_chat_answer_names_paris_and_stops_at_im_end(deployment):
    text, reason = _chat(deployment.client("disaggregated"), QUESTION, temperature=0)
    assert "Paris" in text, text
    assert reason == "stop"  # <|im_end|>, well before max_tokens
    assert (text, reason) == deployment.colocated_chat(temperature=0)


@pytest.mark.parametrize("path", ["disaggregated", "local", "split"])
def test_every_path_equals_colocated(deployment, path):
    router = deployment.routers[path]
    for sampling, prompts in zip(SAMPLINGS, PROMPTS_BY_SAMPLING, strict=True):
        # the path's own prompts, so the decode pod's prefix cache holds none of them
        for prompt in (f"({path}) {text}" for text in prompts):
            want = _complete(deployment.client("colocated"), prompt, **sampling)
            assert _complete(deployment.client(path), prompt, **sampling) == want, (
                path, sampling, prompt[:40])
        assert _chat(deployment.client(path), QUESTION, **sampling) == (
            deployment.colocated_chat(**sampling))
    if path == "local":
        assert router.metric("pdserve_router_local_prefills_total") > 0
    if path == "split":
        assert router.metric("pdserve_router_split_prefills_total") > 0


def test_a_second_turn_is_sent_only_its_cache_miss(deployment):
    decode = deployment.pods["decode"]
    saved = "pdserve_kv_transfer_saved_bytes_total"
    before = decode.metric_value(saved)
    client = deployment.client("disaggregated")
    # a first turn longer than two of the decode pod's 128-token blocks
    opening = {"role": "user", "content": "Read this: " + LONG + " Who built the press?"}
    first, _ = _chat(client, [opening], temperature=0, user="turns")
    turns = [opening, {"role": "assistant", "content": first},
             {"role": "user", "content": "And when?"}]
    second = _chat(client, turns, temperature=0, user="turns")
    assert decode.metric_value(saved) > before
    assert second == _chat(deployment.client("colocated"), turns, temperature=0)
