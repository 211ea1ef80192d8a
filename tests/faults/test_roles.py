"""SIGTERM and kill -9 of each role under a running router, and a decode pod
restarted on the same ports (a new generation) while the prefill pod still
holds pooled KV connections to the old one.

Expected: in-flight requests finish exactly (SIGTERM drains; kill -9 of the
prefill pod leaves the requests that are already decoding untouched) or fail
with a clear error at once (kill -9 of the only decode pod, of the prefill
pod mid-transfer, or of the router: there is nobody to move them to); the
surviving pods hold nothing afterwards (free blocks, landing bytes, threads,
sockets: tests/faults/stack.py's baseline), and the next request is exact.
With several pods of a role the requests move instead and stay exact: kill -9
there is tests/router/test_failover.py; SIGTERM of a lone pod is
tests/integration/test_drain.py.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import pytest

from tests.faults.client import Outcome, generate
from tests.faults.stack import assert_pods_at_baseline, links_to, usage
from tests.integration.pods import PodProcess, start_pod
from tests.redis_server import free_port
from tests.router.router_process import RouterProcess, start_router, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROMPT = " ".join(f"r{i}" for i in range(60))
# tokens: streaming for a while on the tiny model, long enough that two
# streams outlast a 1,000-token prompt's chunked prefill and transfer on a
# loaded machine (300 ended first once decode steps got faster, beside the
# suite)
LONG = 500
# prefill in 64-token chunks: a long prompt's KV leaves over many steps, so a
# kill can land between its first and last layer
POD_FLAGS = {"prefill": {"block_size": 16, "num_blocks": 256, "kv_streams": 2,
                         "max_num_batched_tokens": 64, "grace_period": 30},
             "decode": {"block_size": 16, "num_blocks": 256, "grace_period": 30}}


class Roles:
    """A prefill pod, a decode pod (both on fixed ports, so either can be
    restarted where the router expects it) and a router."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.ports = {role: {"port": free_port(), "metrics_port": free_port()}
                      for role in POD_FLAGS}
        self.ports["decode"]["kv_port"] = free_port()
        self.pods: dict[str, PodProcess] = {}
        self.router: RouterProcess | None = None

    def start_pod(self, role: str) -> PodProcess:
        self.pods[role] = start_pod(role, self.model_dir, **POD_FLAGS[role], **self.ports[role])
        return self.pods[role]

    def start_router(self) -> RouterProcess:
        address = {role: f"127.0.0.1:{ports['port']}" for role, ports in self.ports.items()}
        # no turn computed on the decode pod from what it caches (the
        # within-budget rule): every request here must move KV, and a restarted
        # prefill pod's empty cache would send repeated prompts there
        self.router = start_router(self.model_dir, prefill=[address["prefill"]],
                                   decode=[address["decode"]], request_timeout=60,
                                   local_prefill_within_budget=False)
        wait_ready(self.router)
        return self.router

    def generate(self, max_tokens: int, on_tokens=None, prompt: str = PROMPT) -> Outcome:
        assert self.router is not None
        return generate(self.router.grpc_address, prompt, max_tokens, timeout=60,
                        on_tokens=on_tokens)

    def stop(self) -> None:
        if self.router is not None:
            self.router.process.kill()
        for pod in self.pods.values():
            pod.kill()


@pytest.fixture(scope="module")
def roles(tiny_model_dir):
    started = Roles(tiny_model_dir)
    try:
        for role in POD_FLAGS:
            started.start_pod(role)
        started.start_router()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def expected(roles) -> list[int]:
    """The undisturbed run (also warms both pods and the prefill pod's KV pool)."""
    outcome = roles.generate(LONG)
    assert outcome.error is None, outcome.describe()
    return outcome.tokens


def _signal_after(num: int, send: Callable[[], None], sent: list[int],
                  ) -> Callable[[int], None]:
    """An on_tokens callback that calls `send` once, when `num` tokens are in."""
    def on_tokens(received: int) -> None:
        if received >= num and not sent:
            sent.append(received)
            send()
    return on_tokens


def _usage(roles: Roles) -> dict:
    """Threads and sockets of each pod now (take it while idle: the baseline)."""
    return {name: usage(pod.process.pid) for name, pod in roles.pods.items()}


def _router_links(roles: Roles, role: str) -> int:
    """The router's connections to `role`'s pod: its request channel, its load
    poller's, and its cache-event feed's (each a channel of its own)."""
    return links_to(roles.router.process.pid, roles.pods[role].grpc_port)


def _usage_once_relinked(roles: Roles, role: str, links: int) -> dict:
    """`_usage`, taken once the router again holds the `links` connections it
    held to `role`'s pod before that pod restarted. Being ready needs only
    the request and load channels; the cache-event feed resubscribes at its
    next sync, and a baseline taken before that is one socket short (CI's
    failure of the mid-transfer restart test, after run 26)."""
    _wait(lambda: _router_links(roles, role) >= links,
          f"the router never relinked to the restarted {role} pod", timeout=30)
    return _usage(roles)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_sigterm_of_a_pod_mid_stream_finishes_the_stream_then_it_restarts(roles, expected, role):
    sent: list[int] = []
    pod = roles.pods[role]
    got = roles.generate(LONG, on_tokens=_signal_after(5, pod.sigterm, sent))
    assert sent and sent[0] < LONG, "SIGTERM came too late to be mid-stream"
    assert got.error is None, got.describe()
    assert got.tokens == expected
    assert pod.process.wait(30) == 0
    roles.start_pod(role)  # same ports, new generation
    wait_ready(roles.router, timeout=30)
    again = roles.generate(LONG)
    assert again.error is None, again.describe()
    assert again.tokens == expected


def _in_thread(outcomes: dict[str, Outcome], key: str, call: Callable[[], Outcome]
               ) -> threading.Thread:
    thread = threading.Thread(target=lambda: outcomes.update({key: call()}))
    thread.start()
    return thread


def _wait(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _is_clear_unavailable(outcome: Outcome, reference: list[int]) -> bool:
    """Failed fast with a reason, after tokens that were all right so far."""
    return (outcome.error is not None and outcome.error.code().name == "UNAVAILABLE"
            and bool(outcome.error.details()) and outcome.tokens == reference[:len(outcome.tokens)])


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_kill_9_of_a_pod_during_requests_then_the_survivor_holds_nothing(roles, expected, victim):
    """Two streams decoding and a third request mid-transfer when `victim`
    is killed. The decode pod alone finishes what it holds, so a dead prefill
    pod costs only the request it was prefilling; a dead decode pod costs all
    three (the only one: nowhere to move them)."""
    survivor = "decode" if victim == "prefill" else "prefill"
    baseline, links = _usage(roles), _router_links(roles, victim)
    decode = roles.pods["decode"]
    outcomes: dict[str, Outcome] = {}
    threads = []
    for key in ("stream 1", "stream 2"):  # one after the other: no concurrent transfer
        decoding = threading.Event()
        threads.append(_in_thread(outcomes, key, lambda d=decoding: roles.generate(
            LONG, on_tokens=lambda n, d=d: n >= 5 and d.set())))
        _wait(decoding.is_set, f"{key} never decoded")
    received = _received(decode)
    long_prompt = " ".join(f"k{i}" for i in range(500))  # ~1,000 tokens: ~16 prefill chunks
    threads.append(_in_thread(outcomes, "mid-transfer",
                              lambda: roles.generate(4, prompt=long_prompt)))
    _wait(lambda: _received(decode) > received, "no KV of the long prompt reached the decode pod")
    assert all(thread.is_alive() for thread in threads), "a request ended before the kill"
    roles.pods[victim].kill()
    for thread in threads:
        thread.join(70)  # past the requests' own 60 s deadline
        assert not thread.is_alive(), "a request hung after the kill"
    streams = [outcomes["stream 1"], outcomes["stream 2"]]
    if victim == "prefill":
        assert [s.tokens for s in streams] == [expected, expected], [s.describe() for s in streams]
    else:
        assert all(_is_clear_unavailable(s, expected) for s in streams), [
            s.describe() for s in streams]
        assert all(len(s.tokens) < LONG for s in streams)
    assert outcomes["mid-transfer"].error is not None, outcomes["mid-transfer"].describe()
    # the survivor freed everything the dead pod's requests held
    assert_pods_at_baseline({survivor: roles.pods[survivor]}, {survivor: baseline[survivor]})
    roles.start_pod(victim)  # same ports, new generation
    wait_ready(roles.router, timeout=30)
    again = roles.generate(4, prompt=long_prompt)
    assert again.error is None, again.describe()
    assert _is_clear_unavailable(outcomes["mid-transfer"], again.tokens), \
        outcomes["mid-transfer"].describe()
    again = roles.generate(LONG)
    assert again.tokens == expected, again.describe()
    assert_pods_at_baseline(roles.pods, {**_usage_once_relinked(roles, victim, links),
                                         survivor: baseline[survivor]})


def test_decode_pod_restarted_on_the_same_ports_while_prefill_holds_old_connections(
        roles, expected):
    warm = roles.generate(8)  # the prefill pod's KV streams to this decode pod are pooled
    assert warm.error is None, warm.describe()
    prefill_before, links = _usage(roles)["prefill"], _router_links(roles, "decode")
    migrations = roles.router.metric("pdserve_migrations_total")
    roles.pods["decode"].kill()
    roles.start_pod("decode")
    wait_ready(roles.router, timeout=30)
    got = roles.generate(LONG)
    assert got.error is None, got.describe()
    assert got.tokens == expected
    # the stale pooled connections cost no failed transfer: none moved the request
    assert roles.router.metric("pdserve_migrations_total") == migrations
    # the prefill pod replaced its pooled connections, it did not add to them
    assert_pods_at_baseline(roles.pods, {**_usage_once_relinked(roles, "decode", links),
                                         "prefill": prefill_before})


def _received(pod: PodProcess) -> float:
    try:
        return pod.metric_value("pdserve_kv_received_bytes_total")
    except KeyError:  # nothing received yet
        return 0.0


def test_decode_pod_killed_mid_transfer_then_restarted_on_the_same_ports(roles):
    prompt = " ".join(f"t{i}" for i in range(500))  # ~1,000 tokens: ~16 prefill chunks
    expected = roles.generate(4, prompt=prompt)
    assert expected.error is None, expected.describe()
    # Once more, now wholly cached on the prefill pod (so not split, and each
    # layer in one piece): its KV streams to the decode pod open lazily, one
    # per piece a layer is cut into, and the recomputed-from-cache transfer
    # after the restart below uses them all; the baseline must count them
    # too (runs 23 and 26 saw the pool one stream larger than a baseline
    # taken after the first, split transfer).
    assert roles.generate(4, prompt=prompt).tokens == expected.tokens
    prefill_before, links = _usage(roles)["prefill"], _router_links(roles, "decode")
    decode = roles.pods["decode"]
    received = _received(decode)
    result: dict[str, Outcome] = {}
    thread = threading.Thread(target=lambda: result.update(
        outcome=roles.generate(4, prompt=prompt + " again")))
    thread.start()
    deadline = time.monotonic() + 30
    while _received(decode) == received:  # its first layers landed: mid-transfer
        assert time.monotonic() < deadline, "no KV ever reached the decode pod"
    decode.kill()
    roles.start_pod("decode")  # same ports, new generation
    thread.join(60)
    assert not thread.is_alive(), "the request hung after its decode pod died"
    got = result["outcome"]
    # the only decode pod failed this request: a clear error, not a hang
    assert got.error is not None and got.error.code().name == "UNAVAILABLE", got.describe()
    wait_ready(roles.router, timeout=30)
    again = roles.generate(4, prompt=prompt)
    assert again.error is None, again.describe()
    assert again.tokens == expected.tokens
    # the prefill pod's cut transfer left nothing behind
    assert_pods_at_baseline(roles.pods, {**_usage_once_relinked(roles, "decode", links),
                                         "prefill": prefill_before})


def test_router_killed_mid_stream_fails_the_client_at_once_and_pods_free_the_request(
        roles, expected):
    sent: list[int] = []
    router, baseline = roles.router, _usage(roles)
    got = roles.generate(LONG, on_tokens=_signal_after(5, router.process.kill, sent))
    assert sent, "the stream ended before the kill"
    assert got.error is not None and got.error.code().name == "UNAVAILABLE", got.describe()
    router.process.wait(10)
    assert_pods_at_baseline(roles.pods, baseline)  # the pods saw their caller go, freed all
    roles.start_router()
    again = roles.generate(LONG)
    assert again.tokens == expected, again.describe()


def test_router_sigterm_mid_stream_finishes_the_stream_then_exits_zero(roles, expected):
    sent: list[int] = []
    router, baseline = roles.router, _usage(roles)
    got = roles.generate(LONG, on_tokens=_signal_after(
        5, lambda: router.process.send_signal(signal.SIGTERM), sent))
    assert sent and sent[0] < LONG
    assert got.error is None, got.describe()
    assert got.tokens == expected
    assert router.process.wait(30) == 0
    assert_pods_at_baseline(roles.pods, baseline)
    roles.start_router()
