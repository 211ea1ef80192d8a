"""The first token goes out before the KV transfer is decided, and a transfer
that fails after it still gives the client one exact stream (real processes,
tiny model, the official `openai` client).

How the window is made: the prompt is long and the prefill pod computes it
in 16-token chunks, so its KV reaches the decode pod over many steps. As soon
as the decode pod has received some KV it is frozen (SIGSTOP): it can neither
accept the transfer nor stream anything. The prefill pod still samples token
0, and the client must get it while the decode pod is frozen. Then the decode
pod is killed (SIGKILL): the prefill pod's transfer fails, the request moves
to another decode pod with token 0 as output, and the whole stream must equal
the colocated pod's, with no token repeated or missing.

Cluster (module scope): 1 prefill pod, 3 decode pods (each test kills one),
1 colocated pod (the baseline); a router over the P/D pods, one over the
colocated pod.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.integration.pods import start_pod
from tests.router.router_process import start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    roles = ["prefill"] + ["decode"] * 3 + ["colocated"]
    # small prefill steps: a long prompt's KV goes out over many steps
    flags = {"prefill": {"max_num_batched_tokens": 16}}
    with ThreadPoolExecutor(len(roles)) as pool:
        pods = [f.result() for f in [pool.submit(start_pod, r, tiny_model_dir, **flags.get(r, {}))
                                     for r in roles]]  # fmt: skip
    prefill, decode, colocated = pods[0], pods[1:4], pods[4]
    routers = []
    try:
        # the whole-prompt path: token 0 comes from the prefill pod, before the
        # transfer's verdict (a split's comes from the decode pod, once the
        # head is in: no such window)
        routers.append(start_router(tiny_model_dir, prefill=[prefill.address],
                                    decode=[d.address for d in decode], max_migrations=2,
                                    split_prefill_min_tokens=0))
        routers.append(start_router(tiny_model_dir, colocated=[colocated.address]))
        for router in routers:
            wait_ready(router)
        yield {"prefill": prefill, "decode": decode, "pd": routers[0], "co": routers[1]}
    finally:
        for router in routers:
            router.terminate()
        for pod in pods:
            pod.kill()


def _metric(pod, name: str, **labels: str) -> float:
    try:
        return pod.metric_value(name, **labels)
    except KeyError:  # not observed yet
        return 0.0


def _stream(router, prompt: str, on_first_token=None, **sampling) -> tuple[list[str], int]:
    """Stream a completion; returns (the tokens' texts in order, usage's completion_tokens).
    `on_first_token()` runs as soon as the first token is in the client's hand."""
    client = openai.OpenAI(base_url=router.base_url, api_key="-", max_retries=0, timeout=120)
    tokens: list[str] = []
    usage = 0
    for chunk in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, stream=True, logprobs=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            **sampling):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].logprobs is not None:
            fresh = chunk.choices[0].logprobs.tokens or []
            if fresh and not tokens and on_first_token is not None:
                tokens.extend(fresh)
                on_first_token()
                continue
            tokens.extend(fresh)
    return tokens, usage


@pytest.mark.parametrize(("name", "sampling"), [
    ("greedy", {"temperature": 0.0}),
    ("seeded", {"temperature": 0.9, "top_p": 0.95, "seed": 4242}),
])
def test_transfer_failing_after_the_first_token_keeps_the_stream_exact(cluster, name, sampling):
    pd, prefill = cluster["pd"], cluster["prefill"]
    prompt = f"{name}: " + " ".join(f"w{i}" for i in range(700))
    expected = _stream(cluster["co"], prompt, **sampling)
    live = [d for d in cluster["decode"] if d.alive()]
    received = [_metric(d, "pdserve_kv_received_bytes_total") for d in live]
    failures = _metric(prefill, "pdserve_kv_transfer_failures_total")
    aborts = _metric(prefill, "pdserve_aborts_total")
    transfers = _metric(prefill, "pdserve_kv_transfer_seconds_count")  # completed ones
    migrations = pd.metric("pdserve_migrations_total")
    frozen: list = []

    def freeze_the_receiving_decode_pod() -> None:
        deadline = time.monotonic() + 60
        while not frozen and time.monotonic() < deadline:
            for pod, before in zip(live, received, strict=True):
                if _metric(pod, "pdserve_kv_received_bytes_total") > before:
                    pod.process.send_signal(signal.SIGSTOP)
                    frozen.append(pod)
                    return
            time.sleep(0.002)

    watcher = threading.Thread(target=freeze_the_receiving_decode_pod)
    watcher.start()
    seen_at_first_token: list[tuple[bool, float]] = []

    def first_token_arrived() -> None:
        # token 0 is here although the decode pod could not have accepted the KV
        seen_at_first_token.append((bool(frozen),
                                    _metric(prefill, "pdserve_kv_transfer_seconds_count")))
        victim = frozen[0]
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)

    try:
        got = _stream(pd, prompt, on_first_token=first_token_arrived, **sampling)
    finally:
        watcher.join(60)
        for pod in frozen:
            if pod.alive():
                pod.kill()
    assert seen_at_first_token and seen_at_first_token[0][0], (
        "the decode pod was not frozen before token 0: the window was missed")
    assert seen_at_first_token[0][1] == transfers  # no verdict yet when token 0 arrived
    assert got == expected  # one stream: none repeated, none lost, the same tokens
    assert got[1] == expected[1] == len(expected[0]) == 24
    # the transfer really failed after token 0, and the request moved once. The
    # prefill pod ends the dead transfer one of two ways, whichever comes
    # first: its KV connection breaks (a transfer failure) or the router,
    # having moved the stream, cancels the Prefill call (a client abort);
    # either may come after the client has the moved stream's last token.
    def ended_unsent() -> float:
        return (_metric(prefill, "pdserve_kv_transfer_failures_total")
                + _metric(prefill, "pdserve_aborts_total"))

    deadline = time.monotonic() + 30
    while ended_unsent() <= failures + aborts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended_unsent() > failures + aborts
    # the dead transfer never completed; the moved request's own transfer may have
    assert _metric(prefill, "pdserve_kv_transfer_seconds_count") <= transfers + 1
    assert pd.metric("pdserve_migrations_total") == migrations + 1
