"""Echo, prompt logprobs, max_tokens 0 and /tokenize, /detokenize through
real pod processes (tiny model, float32 on CPU), real routers and the
official `openai` client, disaggregated and colocated; logprobs are checked
against the no-cache reference (log_softmax over the whole prompt's logits).

Cluster (module scope): one prefill, one decode and one colocated pod; one
router over the P/D pair, one over the colocated pod.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from engine.loader import load_model
from engine.reference import reference_logits
from engine.tokenizer import Tokenizer
from tests.integration.pods import start_pod
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ATOL = 1e-4


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(start_pod, role, tiny_model_dir)
                   for role in ("prefill", "decode", "colocated")]
        pods = [f.result() for f in futures]
    prefill, decode, colocated = pods
    routers = {}
    try:
        routers["pd"] = start_router(tiny_model_dir, prefill=[prefill.address],
                                     decode=[decode.address])
        routers["co"] = start_router(tiny_model_dir, colocated=[colocated.address])
        for router in routers.values():
            wait_ready(router)
        yield routers
    finally:
        for router in routers.values():
            router.terminate()
        for pod in pods:
            pod.kill()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, dtype="float32", device="cpu")
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)

    def prompt_logprobs(ids: list[int]) -> list[tuple[float, float]]:
        """(logprob of token i, best logprob at its position), i = 1..P-1."""
        logprobs = reference_logits(model, ids).log_softmax(dim=-1)
        return [(logprobs[i - 1, ids[i]].item(), logprobs[i - 1].max().item())
                for i in range(1, len(ids))]

    return tokenizer, prompt_logprobs


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120)


def _post(router, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(router.base_url.removesuffix("/v1") + path,
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "river", "stone", "quiet", "north", "table", "seven", "light", "open"]
    return " ".join(rng.choice(vocab) for _ in range(words))


@pytest.mark.parametrize("path", ["pd", "co"])
def test_echo_with_logprobs_scores_the_prompt_like_the_reference(cluster, reference, path):
    tokenizer, prompt_logprobs = reference
    prompt = _text(seed=11 if path == "pd" else 12, words=14)
    ids = tokenizer.encode(prompt)
    expected = prompt_logprobs(ids)
    plain = _client(cluster[path]).completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True})
    for _ in range(2):  # the second time the prompt's blocks are cached: still exact
        echoed = _client(cluster[path]).completions.create(
            model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
            extra_body={"ignore_eos": True})
        choice = echoed.choices[0]
        assert choice.text == prompt + plain.choices[0].text
        lp = choice.logprobs
        num = len(ids)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num + 3
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[:num] == [tokenizer.decode([t], skip_special_tokens=False)
                                   for t in ids]
        for i, (logprob, best) in enumerate(expected, start=1):
            assert lp.token_logprobs[i] == pytest.approx(logprob, abs=ATOL), i
            assert max(lp.top_logprobs[i].values()) == pytest.approx(best, abs=ATOL), i
            assert lp.tokens[i] in lp.top_logprobs[i] and len(lp.top_logprobs[i]) <= 3
        assert lp.token_logprobs[num:] == plain.choices[0].logprobs.token_logprobs
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert echoed.usage.prompt_tokens == num and echoed.usage.completion_tokens == 3


@pytest.mark.parametrize("path", ["pd", "co"])
def test_lm_eval_loglikelihood_request(cluster, reference, path):
    """lm-evaluation-harness local-completions: token ids, echo, logprobs 1,
    max_tokens 0; it sums token_logprobs over the continuation and calls it
    greedy when each continuation token's logprob is its position's best."""
    tokenizer, prompt_logprobs = reference
    context = tokenizer.encode(_text(seed=21, words=10))
    continuation = tokenizer.encode(" " + _text(seed=22, words=3), add_special_tokens=False)
    ids = context + continuation
    expected = prompt_logprobs(ids)
    response = _client(cluster[path]).completions.create(
        model="tiny", prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True, seed=1234)
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert choice.text == tokenizer.decode(ids)
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids)
    ctxlen = len(context)
    got = sum(lp.token_logprobs[ctxlen:])
    want = sum(logprob for logprob, _ in expected[ctxlen - 1:])
    assert got == pytest.approx(want, abs=ATOL * len(continuation))
    greedy = all(tok == max(top.values())
                 for tok, top in zip(lp.token_logprobs[ctxlen:], lp.top_logprobs[ctxlen:],
                                     strict=True))
    assert greedy == all(abs(logprob - best) < 1e-6 for logprob, best in expected[ctxlen - 1:])
    # the same, streamed: one chunk with the prompt, then [DONE]
    chunks = list(_client(cluster[path]).completions.create(
        model="tiny", prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True,
        stream=True))
    (chunk,) = chunks
    assert chunk.choices[0].text == choice.text and chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].logprobs.token_logprobs == lp.token_logprobs


@pytest.mark.parametrize("path", ["pd", "co"])
def test_echo_without_logprobs_and_vllm_prompt_logprobs(cluster, reference, path):
    tokenizer, prompt_logprobs = reference
    prompt = _text(seed=31, words=6)
    ids = tokenizer.encode(prompt)
    client = _client(cluster[path])
    only = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True)
    assert only.choices[0].text == prompt and only.choices[0].logprobs is None
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert streamed == whole.choices[0].text and streamed.startswith(prompt)
    assert len(streamed) > len(prompt)
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                       temperature=0, extra_body={"prompt_logprobs": 1})
    entries = scored.choices[0].model_extra["prompt_logprobs"]
    assert scored.choices[0].text == whole.choices[0].text[len(prompt):][: len(
        scored.choices[0].text)]
    assert len(entries) == len(ids) and entries[0] is None
    for i, (logprob, best) in enumerate(prompt_logprobs(ids), start=1):
        own = entries[i][str(ids[i])]
        assert own["logprob"] == pytest.approx(logprob, abs=ATOL)
        top = [e for e in entries[i].values() if e["rank"] == 1]
        assert len(top) == 1 and top[0]["logprob"] == pytest.approx(best, abs=ATOL)


def test_tokenize_and_detokenize(cluster, reference):
    tokenizer, _ = reference
    router = cluster["pd"]
    prompt = _text(seed=41, words=8)
    status, body = _post(router, "/tokenize", {"model": "tiny", "prompt": prompt})
    assert status == 200
    assert body["tokens"] == tokenizer.encode(prompt) and body["count"] == len(body["tokens"])
    max_model_len = body["max_model_len"]
    assert max_model_len > 0
    status, bare = _post(router, "/tokenize", {"prompt": prompt, "add_special_tokens": False})
    assert status == 200 and bare["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    status, chat = _post(router, "/tokenize", {"messages": [{"role": "user", "content": prompt}]})
    assert status == 200
    assert chat["tokens"] == tokenizer.encode_chat([{"role": "user", "content": prompt}])
    status, back = _post(router, "/detokenize", {"tokens": bare["tokens"]})
    assert status == 200 and back == {"prompt": tokenizer.decode(bare["tokens"])}
    vocab = tokenizer.vocab_size
    for path, request, fragment in [
        ("/detokenize", {"tokens": [1, vocab]}, f"holds {vocab}, outside the vocabulary"),
        ("/detokenize", {"tokens": [1, "2"]}, "must be a list of integer token ids"),
        ("/detokenize", {"tokens": [1] * (max_model_len + 1)},
         f"is {max_model_len + 1} tokens, over the model's context of {max_model_len}"),
        ("/tokenize", {"prompt": "x", "messages": []}, "exactly one of 'prompt'"),
        ("/tokenize", {}, "exactly one of 'prompt'"),
        ("/tokenize", {"prompt": 3}, "'prompt' must be a string"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "no"},
         "'add_special_tokens' must be a boolean"),
        ("/tokenize", {"prompt": " seven" * (max_model_len + 1)},
         f"over the model's context of {max_model_len}"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "does not exist"),
    ]:
        status, body = _post(router, path, request)
        assert status in (400, 404), (path, request, body)
        assert fragment in body["error"]["message"], (path, request, body)
