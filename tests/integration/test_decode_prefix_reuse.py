"""A prompt computed on a decode pod is not lost to the next turn (issue 42).

Real processes on loopback: a router at its default routing policy, one
prefill pod and two decode pods with their prefix cache on (their default
since 2026-11-29: no flag is passed), `tiny` model. The router has
`--local-prefill-below 64`, so a short first turn is computed on a decode
pod (no prefill pod, no transfer). While a long
request holds the first decode pod (A, the least-loaded order's pick among
equals), the first turn goes to the other (B). Then, both pods idle again:

* a follow-up turn (first prompt + its answer + 80 new tokens: too many new
  tokens for the decode pod to compute, so the P/D path) is placed on B,
  where the least-loaded order alone would pick A: B's cached prefix is not
  sent (its saved-bytes counter grows, A receives nothing), and the
  output equals the plain path's;
* a follow-up with 10 new tokens is computed on B itself, with the prefix as
  cache hits (`usage.prompt_tokens_details.cached_tokens` via the `openai`
  client), and the same output as the plain path.

A second router, with no flags at all, shows the same for a prompt the
decode pod received by transfer: the test itself sends the first turn's KV
from the prefill pod to B (so no load or timing decides where it lands), the
router follows the decode pods' cache events under the default policy, and
the next turn goes back to B, the pod that holds the prompt. A next turn
with 30 new tokens is computed on B at the defaults (B holds a block of the
answer it generated, which the prefill pod lacks, and the rest fits its ITL
budget: engine/local_rule.py), with that history as cache hits, and the
prefill pod then computes that turn and its answer in the background
(router/flow/prefill_warm.py); one with 80 new tokens takes the P/D path,
with the prefill pod's cache holding the whole context and only the
uncached tail sent to B.

The plain path is Decode.Generate(remote_prefill=false) on a decode pod,
run last in each test so it cannot warm a cache the routing depends on.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import grpc
import openai
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.flows import colocated_generate, disaggregated_generate
from tests.integration.pods import PodProcess, start_pods
from tests.router.router_process import RouterProcess, start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK = 16
BELOW = 64  # --local-prefill-below: fewer new tokens than this compute on a decode pod
MAX_TOKENS = 24
DECODE_FLAGS = {"block_size": BLOCK, "num_blocks": 128}  # the prefix cache: on by default
WAIT_S = 60.0


@pytest.fixture(scope="module")
def stack(tiny_model_dir) -> Iterator[tuple[dict[str, RouterProcess], dict[str, PodProcess]]]:
    pods = start_pods({"prefill": ("prefill", {}), "d1": ("decode", DECODE_FLAGS),
                       "d2": ("decode", DECODE_FLAGS)}, tiny_model_dir)
    routers: dict[str, RouterProcess] = {}
    addresses = dict(prefill=[pods["prefill"].address],
                     decode=[pods["d1"].address, pods["d2"].address])
    try:
        routers["local"] = start_router(tiny_model_dir, local_prefill_below=BELOW,
                                        **addresses)
        routers["plain"] = start_router(tiny_model_dir, **addresses)
        routers["answers"] = start_router(tiny_model_dir, **addresses)  # the defaults too
        for router in routers.values():
            wait_ready(router)
        yield routers, pods
    finally:
        for router in routers.values():
            router.terminate()
        for pod in pods.values():
            pod.kill()


def _sampling(max_tokens: int = MAX_TOKENS) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _generate(stub: pdserve_pb2_grpc.RouterStub, prompt: list[int]) -> tuple[list[int], str]:
    """The router's gRPC Generate: (token ids, text)."""
    messages = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt,
                                                     sampling=_sampling()), timeout=120))
    assert messages[-1].finish_reason == "length"
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages)


def _wait_for(what: str, check, router: RouterProcess) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; router log:\n"
                                 f"{router.log_tail()}")
        time.sleep(0.05)


def _decode_pods(pods) -> tuple[PodProcess, PodProcess]:
    """(A, B): A sorts first, the least-loaded order's pick among equals."""
    a, b = sorted((pods["d1"], pods["d2"]), key=lambda p: p.address)
    return a, b


def _first_turn_on_b(router: RouterProcess, stub, pods, prompt: list[int],
                     on_b: str) -> list[int]:
    """`prompt`'s answer, computed while a long request holds A (so on B,
    as `on_b`, a counter of B's, shows); returns once A is idle again and
    the router's index holds B's blocks of prompt + answer."""
    a, b = _decode_pods(pods)
    holder = stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8],
                                              sampling=_sampling(1000)), timeout=120)
    try:
        next(holder)
        next(holder)  # past the first token (a prefill pod's, on the P/D path)
        running = "pdserve_requests_running"
        _wait_for("the holder to run", lambda: a.metric_value(running)
                  + b.metric_value(running) == 1, router)
        assert a.metric_value(running) == 1, "the holder is not on A"
        before = b.metric_value(on_b)
        answer, _ = _generate(stub, prompt)
        assert b.metric_value(on_b) > before, "the first turn was not served on B"
    finally:
        holder.cancel()
    _wait_for("A idle", lambda: a.metric_value("pdserve_requests_running") == 0, router)
    # prompt + answer: 64 tokens, of which B computed 63: 3 full blocks
    _wait_for("the router to learn B's blocks", lambda: router.metric(
        "pdserve_router_cache_index_blocks", pod=b.address) >= 3, router)
    time.sleep(0.5)  # a poll or two: the router sees A idle too (else B wins anyway)
    return answer


def _follow_up_on_b(stub, pods, prompt: list[int]) -> list[int]:
    """`prompt` through the P/D path lands on B, which is sent only its
    uncached tail; A receives nothing."""
    a, b = _decode_pods(pods)
    saved, a_bytes = (b.metric_value("pdserve_kv_transfer_saved_bytes_total"),
                      a.metric_value("pdserve_kv_transfer_bytes_total"))
    tokens, _ = _generate(stub, prompt)
    assert b.metric_value("pdserve_kv_transfer_saved_bytes_total") > saved, (
        "the follow-up did not reuse B's cached prefix")
    assert a.metric_value("pdserve_kv_transfer_bytes_total") == a_bytes
    return tokens


def _assert_plain_path(pods, outputs: dict[str, tuple[list[int], list[int]]]) -> None:
    """Each (prompt, tokens) equals the plain path's tokens on pod A."""
    a, _ = _decode_pods(pods)
    with grpc.insecure_channel(a.address) as pod_channel:
        plain = pdserve_pb2_grpc.DecodeStub(pod_channel)
        for name, (prompt, tokens) in outputs.items():
            reference = colocated_generate(plain, f"plain-{name}", prompt, _sampling())
            assert tokens == reference.token_ids, name


def test_the_next_turn_goes_where_the_decode_pod_computed_the_prefix(stack):
    routers, pods = stack
    router = routers["local"]
    rng = random.Random(42)
    first_prompt = [rng.randrange(5, 1100) for _ in range(40)]
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        # 40 < 64 new tokens: computed on a decode pod (its prefix cache looked up)
        answer = _first_turn_on_b(router, stub, pods, first_prompt,
                                  "pdserve_prefix_cache_queries_total")
        context = first_prompt + answer
        # 80 new tokens on B (>= 64): the P/D path, on B, only the uncached tail sent
        long_turn = context + [rng.randrange(5, 1100) for _ in range(80)]
        long_tokens = _follow_up_on_b(stub, pods, long_turn)
        # 10 new tokens after B's 48 cached: computed on B, the prefix as cache hits
        short_turn = context + [rng.randrange(5, 1100) for _ in range(10)]
        short_tokens, short_text = _generate(stub, short_turn)
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0,
                           timeout=120)
    reply = client.completions.create(model="tiny", prompt=short_turn, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == len(short_turn)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 3 * BLOCK
    assert reply.choices[0].text == short_text
    _assert_plain_path(pods, {"long": (long_turn, long_tokens),
                              "short": (short_turn, short_tokens)})


def _first_turn_sent_to_b(router: RouterProcess, pods, prompt: list[int]) -> list[int]:
    """`prompt`'s answer on the P/D path the test drives itself: the prefill
    pod computes it and sends its KV to B (no routing decides where), then
    returns once the router's index holds B's new blocks of prompt + answer."""
    _, b = _decode_pods(pods)
    blocks = router.metric("pdserve_router_cache_index_blocks", pod=b.address)
    with grpc.insecure_channel(pods["prefill"].address) as p_channel, \
            grpc.insecure_channel(b.address) as b_channel:
        answer = disaggregated_generate(pdserve_pb2_grpc.PrefillStub(p_channel),
                                        pdserve_pb2_grpc.DecodeStub(b_channel),
                                        "first-turn-on-b", prompt, _sampling())
    assert answer.finish_reason == "length"
    # prompt + answer: 64 tokens, of which B holds 63 (40 received, 23 computed): 3 blocks
    _wait_for("the router to learn B's blocks", lambda: router.metric(
        "pdserve_router_cache_index_blocks", pod=b.address) >= blocks + 3, router)
    return answer.token_ids


def test_at_the_defaults_the_next_turn_goes_where_the_prompt_was_sent(stack):
    routers, pods = stack
    router = routers["plain"]
    a, b = _decode_pods(pods)
    _wait_for("A idle", lambda: a.metric_value("pdserve_requests_running") == 0, router)
    rng = random.Random(43)
    first_prompt = [rng.randrange(5, 1100) for _ in range(40)]
    # B received the prompt's KV by transfer and computed its answer; A,
    # idle and first in the least-loaded order, holds neither
    answer = _first_turn_sent_to_b(router, pods, first_prompt)
    context = first_prompt + answer
    # 30 new tokens: B holds 48 of the context (a block of its own answer
    # among them), more than the prefill pod's 32, and 46 new tokens fit
    # its ITL budget on an idle pod: B computes them, the 48 as cache hits
    short_turn = context + [rng.randrange(5, 1100) for _ in range(30)]
    local = router.metric("pdserve_router_local_prefills_total")
    warms = router.metric("pdserve_router_prefill_warms_total", outcome="done")
    received = b.metric_value("pdserve_kv_transfer_bytes_total")
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0,
                           timeout=120)
    # streamed: the client stops reading at the last chunk, as streaming clients do
    chunks = list(client.completions.create(
        model="tiny", prompt=short_turn, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    short_text_http = "".join(c.choices[0].text for c in chunks if c.choices)
    assert router.metric("pdserve_router_local_prefills_total") == local + 1
    assert b.metric_value("pdserve_kv_transfer_bytes_total") == received
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3 * BLOCK
    # the prefill pod then computes the short turn and its answer in the
    # background (it had only the first prompt's 2 blocks)
    _wait_for("the prefill pod's warm-up", lambda: router.metric(
        "pdserve_router_prefill_warms_total", outcome="done") == warms + 1, router)
    # 80 new tokens after B's 64 cached (the short turn computed its last
    # context block): more than a chunk, so the P/D path, on B, only the
    # uncached tail sent; the prefill pod has the whole context: 4 blocks
    long_turn = context + [rng.randrange(5, 1100) for _ in range(80)]
    reply = client.completions.create(model="tiny", prompt=long_turn, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        short_tokens, short_text = _generate(stub, short_turn)  # computed on B again
        long_tokens = _follow_up_on_b(stub, pods, long_turn)
    assert short_text == short_text_http
    _assert_plain_path(pods, {"short": (short_turn, short_tokens),
                              "long": (long_turn, long_tokens)})


def test_a_sessions_answer_is_warmed_on_its_prefill_pod(stack):
    """`--warm-session-answers` (the default): after a P/D turn with a session id, the
    prefill pod computes the answer in the background, so the session's
    next turn finds prompt and answer cached there (4 blocks, where the
    prompt alone is 2)."""
    routers, pods = stack
    router = routers["answers"]
    rng = random.Random(44)
    first_prompt = [rng.randrange(5, 1100) for _ in range(40)]
    warms = router.metric("pdserve_router_prefill_warms_total", outcome="done")
    prefill = pods["prefill"].address
    blocks = router.metric("pdserve_router_cache_index_blocks", pod=prefill)
    with grpc.insecure_channel(router.grpc_address) as channel:
        messages = list(pdserve_pb2_grpc.RouterStub(channel).Generate(pb.GenerateRequest(
            prompt_token_ids=first_prompt, sampling=_sampling(), session_id="chat-1"),
            timeout=120))
    answer = [t for m in messages for t in m.token_ids]
    _wait_for("the answer's warm-up", lambda: router.metric(
        "pdserve_router_prefill_warms_total", outcome="done") == warms + 1, router)
    # the router's index learns the prefill pod's 4 blocks (2 of them the
    # warm-up's), so no rule sends the next turn elsewhere
    _wait_for("the router to learn the prefill pod's blocks", lambda: router.metric(
        "pdserve_router_cache_index_blocks", pod=prefill) >= blocks + 4, router)
    turn = first_prompt + answer + [rng.randrange(5, 1100) for _ in range(30)]
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0,
                           timeout=120)
    reply = client.completions.create(model="tiny", prompt=turn, max_tokens=MAX_TOKENS,
                                      temperature=0, user="chat-1",
                                      extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK
