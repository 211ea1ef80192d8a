"""The fault suite's stack (tests/faults/stack.py), started once for the
package: a prefill pod, a TCP decode pod and a router with a fault proxy on
each of their three links, and a gRPC-connector decode pod behind its own KV
proxy. `faults` (the stack for one test) heals every link after the test and
checks the pods are back at baseline and serving exactly."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.faults.client import generate
from tests.faults.proxy import FaultProxy
from tests.faults.stack import FaultStack, assert_back_to_baseline
from tests.integration.flows import disaggregated_generate
from tests.integration.pods import start_pods
from tests.router.router_process import start_router, wait_ready

# Short deadlines so a lost transfer fails within a test's few seconds.
TRANSFER_TIMEOUT_S = 3.0
RESERVATION_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 8.0
WARM_UP = "warm up"
KV_HOST = "127.0.0.2"  # the decode pod advertises this; the KV proxy listens there

# The decode pods keep no prefix cache (on by default): the faults below are
# met by whole transfers, and the package repeats its prompts, which a
# decode pod's cache would turn into cache-miss-only transfers of a block
# or none. tests/faults/test_miss_only_faults.py runs faults on those.
POD_SPECS = {
    # small steps: a 600-token prompt's KV leaves in ~10 chunks over 2 streams
    "prefill": ("prefill", {"block_size": 16, "num_blocks": 256,
                            "max_num_batched_tokens": 64, "kv_streams": 2}),
    "decode": ("decode", {"block_size": 16, "num_blocks": 256, "kv_transport": "tcp",
                          "advertise_host": KV_HOST, "transfer_timeout": TRANSFER_TIMEOUT_S,
                          "reservation_timeout": RESERVATION_TIMEOUT_S,
                          "landing_memory": "16MiB", "no_prefix_cache": True}),
    # not behind the router: the gRPC KV connector (its faults, and fuzzing KVTransfer)
    "grpc_decode": ("decode", {"block_size": 16, "num_blocks": 64, "kv_transport": "grpc",
                               "advertise_host": KV_HOST,
                               "transfer_timeout": TRANSFER_TIMEOUT_S,
                               "reservation_timeout": RESERVATION_TIMEOUT_S,
                               "landing_memory": "16MiB", "no_prefix_cache": True}),
}


def _local(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


@pytest.fixture(scope="package")
def stack(tiny_model_dir) -> Iterator[FaultStack]:
    pods = start_pods(POD_SPECS, tiny_model_dir)
    prefill, decode = pods["prefill"], pods["decode"]
    kv = FaultProxy((KV_HOST, decode.kv_port), ("127.0.0.1", decode.kv_port)).start()
    grpc_decode = pods["grpc_decode"]
    grpc_kv = FaultProxy((KV_HOST, grpc_decode.kv_port),
                         ("127.0.0.1", grpc_decode.kv_port)).start()
    prefill_grpc = FaultProxy(("127.0.0.1", 0), _local(prefill.address)).start()
    decode_grpc = FaultProxy(("127.0.0.1", 0), _local(decode.address)).start()
    routers = []
    try:
        # The idle side off: a decode pod computing a whole prompt itself (when
        # the prefill path's estimated wait is long, as on a loaded machine)
        # would send no KV over the faulty link these tests are about.
        common = dict(prefill=[prefill_grpc.address], decode=[decode_grpc.address],
                      request_timeout=REQUEST_TIMEOUT_S, max_migrations=2,
                      local_prefill_max_tokens=0)
        # the whole-prompt path: a lost sender restarts against the same reservation
        router = start_router(tiny_model_dir, split_prefill_min_tokens=0, **common)
        routers.append(router)
        split_router = start_router(tiny_model_dir, **common)
        routers.append(split_router)
        wait_ready(router)
        wait_ready(split_router)
        faults = FaultStack(prefill, decode, router, kv, prefill_grpc, decode_grpc, {},
                            grpc_decode, grpc_kv, split_router)
        yield faults
    finally:
        for router in routers:
            router.terminate()
        for proxy in (kv, prefill_grpc, decode_grpc, grpc_kv):
            proxy.close()
        for pod in pods.values():
            pod.kill()


@pytest.fixture
def faults(stack, reference) -> Iterator[FaultStack]:
    """The stack; after the test: healed, back at its baseline, and serving
    the warm-up prompt exactly again (the survivors keep serving)."""
    try:
        yield stack
    finally:
        stack.heal()
    assert_back_to_baseline(stack)
    wait_ready(stack.router, timeout=20)  # its health poll sees the healed links
    again = generate(stack.router.grpc_address, WARM_UP, 4, timeout=30)
    assert again.error is None, again.describe()
    assert again.tokens == reference(WARM_UP, 4)


@pytest.fixture(scope="package")
def reference(stack):
    """`reference(prompt, max_tokens)`: the tokens of an undisturbed run (cached).
    The first call also records the pods' baseline, after that warm-up."""
    cache: dict[tuple[str, int], list[int]] = {}

    def tokens(prompt: str, max_tokens: int) -> list[int]:
        key = (prompt, max_tokens)
        if key not in cache:
            stack.heal()
            outcome = generate(stack.router.grpc_address, prompt, max_tokens, timeout=60)
            assert outcome.error is None, outcome.describe()
            cache[key] = outcome.tokens
        return cache[key]

    tokens(WARM_UP, 4)
    warm_up_grpc_decode(stack)
    warm_up_grammar(stack)
    warm_up_split(stack)
    stack.record_baseline()
    return tokens


def warm_up_split(stack: FaultStack) -> None:
    """One split request through the split router: its first opens that
    router's connections to the pods and the decode pod's tail worker (a
    thread that then stays), which the baseline must hold."""
    prompt = " ".join(f"warm{i}" for i in range(300))
    splits = stack.split_router.metric("pdserve_router_split_prefills_total")
    outcome = generate(stack.split_router.grpc_address, prompt, 2, timeout=60)
    assert outcome.error is None, outcome.describe()
    assert stack.split_router.metric("pdserve_router_split_prefills_total") == splits + 1


def warm_up_grammar(stack: FaultStack) -> None:
    """One structured-output request through the router: a pod makes its
    grammar matchers' thread pool (llguidance's executor, a fixed number of
    threads per process) on its first such request, and the baseline must
    hold it, or the first test that asks for a grammar reads as a thread leak."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": WARM_UP}],
            "max_tokens": 4, "response_format": {"type": "json_object"}}
    request = urllib.request.Request(stack.router.url("/v1/chat/completions"),
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200


def warm_up_grpc_decode(stack: FaultStack) -> list[int]:
    """One transfer into the gRPC-connector decode pod, driven as the router
    would (it is outside the router); returns the tokens."""
    sampling = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with grpc.insecure_channel(stack.grpc_decode.address) as dc, \
            grpc.insecure_channel(stack.prefill.address) as pc:
        return disaggregated_generate(
            pdserve_pb2_grpc.PrefillStub(pc), pdserve_pb2_grpc.DecodeStub(dc), "warm-grpc-kv",
            list(range(5, 69)), sampling).token_ids
