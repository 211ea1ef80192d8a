"""Sampling parameters end to end: real pod processes, real routers, the
official `openai` client (and the router's gRPC door where the test needs
token ids).

Cluster (module scope): one prefill, one decode and one colocated pod; a
router over the P/D pair, one over the colocated pod; and a colocated pod
with a small KV cache (128 tokens) behind its own router, for the decode
reservation's limit. tests/integration/openai_schema_table.py holds the
per-field table of `test_every_openai_field_is_honoured_or_refused`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from router.http import openai_fields
from tests.integration.openai_schema_table import (
    UNKNOWN_FIELDS,
    chat_fields,
    completion_fields,
    schema_fields,
)
from tests.integration.pods import start_pod
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT_IDS = [20, 21, 22, 23, 24, 25]
SMALL_KV_TOKENS = 128


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    roles = [("prefill", {}), ("decode", {}), ("colocated", {}),
             ("colocated", {"num_blocks": SMALL_KV_TOKENS // 16, "block_size": 16})]
    with ThreadPoolExecutor(len(roles)) as pool:
        futures = [pool.submit(start_pod, role, tiny_model_dir, timeout=400, **flags)
                   for role, flags in roles]
        pods = [f.result() for f in futures]
    prefill, decode, colocated, small = pods
    routers = {}
    try:
        routers["pd"] = start_router(tiny_model_dir, prefill=[prefill.address],
                                     decode=[decode.address])
        routers["co"] = start_router(tiny_model_dir, colocated=[colocated.address])
        routers["small"] = start_router(tiny_model_dir, colocated=[small.address])
        for router in routers.values():
            wait_ready(router)
        yield routers
    finally:
        for router in routers.values():
            router.terminate()
        for pod in pods:
            pod.kill()


@pytest.fixture(scope="module")
def eos_id(tiny_model_dir) -> int:
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120)


def _grpc(router, sampling: pb.SamplingParams, prompt_ids=PROMPT_IDS,
          messages=()) -> tuple[list[int], str]:
    """Token ids and finish reason of one request through the router's gRPC door."""
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        if messages:
            request = pb.GenerateRequest(
                messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
                sampling=sampling)
        else:
            request = pb.GenerateRequest(prompt_token_ids=prompt_ids, sampling=sampling)
        replies = list(stub.Generate(request, timeout=120))
    return [t for m in replies for t in m.token_ids], replies[-1].finish_reason


def _sampling(**fields) -> pb.SamplingParams:
    bias = fields.pop("logit_bias", {})
    message = pb.SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **fields})
    for token, value in bias.items():
        message.logit_bias[token] = value
    return message


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 17)])
def test_disaggregated_equals_colocated_with_penalties_and_bias(cluster, temperature, seed):
    plain, _ = _grpc(cluster["co"], _sampling(temperature=temperature, seed=seed))
    sampling = _sampling(temperature=temperature, seed=seed, frequency_penalty=1.5,
                         presence_penalty=0.5, repetition_penalty=1.3, min_tokens=4,
                         logit_bias={plain[1]: -100, 30: 3.0})
    pd, _ = _grpc(cluster["pd"], sampling)
    co, _ = _grpc(cluster["co"], sampling)
    assert pd == co and len(pd) == 12
    assert plain[1] not in pd and pd != plain


def test_logit_bias_changes_the_greedy_token(cluster):
    for router in ("pd", "co"):
        (greedy,), _ = _grpc(cluster[router], _sampling(temperature=0, max_tokens=1))
        client = _client(cluster[router])
        again = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=1,
                                          temperature=0, logprobs=1)
        biased = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=1,
                                           temperature=0, logprobs=1,
                                           logit_bias={str(greedy): -100})
        assert biased.choices[0].logprobs.tokens != again.choices[0].logprobs.tokens
        # logprobs stay the model's: the banned token is still the most likely one
        top = [r.choices[0].logprobs.top_logprobs[0] for r in (biased, again)]
        assert top[0] == top[1]
        (other,), _ = _grpc(cluster[router], _sampling(temperature=0, max_tokens=1,
                                                       logit_bias={greedy: -100}))
        assert other != greedy


def test_min_tokens_holds_off_eos(cluster, eos_id):
    for router in ("pd", "co"):
        forced = _sampling(temperature=0, ignore_eos=False, logit_bias={eos_id: 100})
        assert _grpc(cluster[router], forced) == ([eos_id], "stop")
        forced.min_tokens = 3
        tokens, reason = _grpc(cluster[router], forced)
        assert reason == "stop" and len(tokens) == 4 and tokens[3] == eos_id
        assert eos_id not in tokens[:3]


def test_stop_token_ids_on_both_endpoints(cluster):
    messages = [("user", "Hi!")]
    for router in ("pd", "co"):
        client = _client(cluster[router])
        tokens, _ = _grpc(cluster[router], _sampling(temperature=0))
        stop = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
        cut = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True,
                                                                   "stop_token_ids": [stop]})
        assert cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens == tokens.index(stop) + 1
        chat_tokens, _ = _grpc(cluster[router], _sampling(temperature=0), messages=messages)
        stop = next(t for i, t in enumerate(chat_tokens) if i >= 2 and t not in chat_tokens[:i])
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=12,
            temperature=0, extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
        assert chat.choices[0].finish_reason == "stop"
        assert chat.usage.completion_tokens == chat_tokens.index(stop) + 1


def test_n_choices_keep_their_seeded_streams_and_sum_usage(cluster):
    client = _client(cluster["pd"])
    args = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=8, temperature=1.0, seed=5,
                extra_body={"ignore_eos": True})
    one = client.completions.create(**args)
    three = client.completions.create(n=3, **args)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text  # choice 0 keeps the request's seed
    assert len({c.text for c in three.choices}) > 1
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 24
    assert client.completions.create(n=3, **args).choices[2].text == three.choices[2].text
    co = _client(cluster["co"]).completions.create(n=3, **args)
    assert [c.text for c in co.choices] == [c.text for c in three.choices]
    # streaming: chunks of both choices, each with its index; texts as without streaming
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=6,
                temperature=1.0, seed=9, n=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(stream=True, **chat):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_chat_without_max_tokens_reserves_what_the_pod_holds(cluster):
    client = _client(cluster["small"])
    messages = [{"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens + whole.usage.completion_tokens == SMALL_KV_TOKENS
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=500)
    error = info.value.body
    assert error["param"] == "max_tokens"
    assert f"the largest decode pod holds KV for {SMALL_KV_TOKENS} tokens" in error["message"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_every_openai_field_is_honoured_or_refused(cluster, kind, eos_id):
    """Every field of the installed openai package's request types (both
    endpoints') and every field the router knows has an entry in this
    endpoint's table, and so do the unknown fields; each entry's check runs
    against the P/D router."""
    table = completion_fields(eos_id) if kind == "completion" else chat_fields(eos_id)
    fields = (schema_fields("completion") | schema_fields("chat")
              | openai_fields.COMPLETION_FIELDS | openai_fields.CHAT_FIELDS | set(UNKNOWN_FIELDS))
    missing = fields - set(table)
    assert not missing, f"request fields without an entry: {sorted(missing)}"
    client = _client(cluster["pd"])
    for name, check in table.items():
        check(client, name)
