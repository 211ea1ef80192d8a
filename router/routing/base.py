"""Routing interfaces: what a pod looks like to the router, and the pool of pods.

The router server (router engineer A) owns one `PodPool` per process and one
`RoutingPolicy` (router/routing/policy.py) on top of it. Everything here runs
on the router's asyncio event loop: `PodPool.start()` / `close()` are awaited
by the server at startup and shutdown; `pods()`, `is_ready()` and `track()`
are plain synchronous calls made from request handlers on that same loop, so
no locks are needed (there is exactly one thread touching this state).

Loads come from two places with different freshness:

* the pod's own `LoadReport` (GetLoad), polled every `--load-poll-interval`
  seconds — it sees every router's traffic but is up to one interval stale;
* the router's in-flight count per pod (`PodPool.track()`), updated the moment
  a request is sent and finished — exact, but only this router's traffic.

`PodLoad` carries both; the policy combines them.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from proto.address import split_host_port
from proto.roles import PodRole

ROLES: tuple[str, ...] = tuple(role.value for role in PodRole)


class NoPodAvailable(Exception):
    """No healthy pod can take this request; the router answers HTTP 503 with `reason`.

    Raised by `RoutingPolicy.choose_*` (and by the server when every candidate
    refused). `reason` is a sentence meant for the client, e.g.
    "no healthy prefill pod (2 known, 0 healthy)".
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_role(role: str) -> str:
    """Return `role` if it is one of ROLES, else raise ValueError naming the allowed ones."""
    PodRole.parse(role)
    return role


def check_address(address: str) -> str:
    """Return `address` if it looks like host:port with a port in 1..65535, else ValueError."""
    split_host_port(address, "pod address")
    return address


@dataclass(frozen=True, slots=True)
class PodLoad:
    """One pod as the router sees it: its last `LoadReport` plus this router's in-flight count.

    Built by the `PodPool` on every `pods()` call, so `in_flight` is always
    current while the report fields are as fresh as the last successful poll.
    """

    address: str
    role: str  # "prefill" | "decode" | "colocated"
    healthy: bool
    generation: int  # the pod's generation (changes on restart)
    num_waiting: int  # queued requests on the pod
    num_waiting_tokens: int  # queued prompt tokens not yet computed
    num_running: int  # sequences in the pod's running batch
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    prefix_hit_rate: float  # blocks hit / blocks queried since the pod started
    in_flight: int  # requests this router has sent there and not yet finished
    in_flight_tokens: int = 0  # prompt tokens of those requests (passed to track())
    # where the pod publishes its prefix-cache events ("" = CacheEvents.Subscribe only)
    cache_events_channel: str = ""
    device: str = ""  # the pod's torch device type: "cpu", "cuda" ("" = not reported)
    # processes the pod's engine spans; its block counts are already the whole pod's
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_address(self.address)
        check_role(self.role)
        for name in (
            "num_waiting",
            "num_waiting_tokens",
            "num_running",
            "num_free_blocks",
            "num_total_blocks",
            "block_size",
            "in_flight",
            "in_flight_tokens",
        ):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"PodLoad.{name} must be >= 0; got {value} for {self.address}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"PodLoad.tensor_parallel_size must be >= 1; got "
                             f"{self.tensor_parallel_size} for {self.address}")
        if not 0.0 <= self.prefix_hit_rate <= 1.0:
            raise ValueError(
                f"PodLoad.prefix_hit_rate must be in [0, 1]; got {self.prefix_hit_rate}"
            )


def load_key(load: PodLoad) -> tuple[int, int, str]:
    """A pod's place in the load order: running + this router's in-flight
    sequences, then most free KV blocks, then address. `RoutingPolicy`
    ranks decode pods so when no cached prefix decides."""
    return (load.num_running + load.in_flight, -load.num_free_blocks, load.address)


class PodPool(abc.ABC):
    """The set of known pods with their loads; discovery and polling are the subclass's job.

    Implementations: `router.registry.poller.PolledPodPool` over a static
    address list (`router.registry.static`) or Redis heartbeats
    (`router.registry.redis_registry`).

    This base class owns the in-flight accounting, which is the same for every
    implementation: `track(address)` is entered by the server when it sends a
    request to a pod and exited when that request is over (finished, failed or
    cancelled), so the count can never leak.
    """

    def __init__(self) -> None:
        # address -> [requests, prompt tokens] this router has outstanding there
        self._in_flight: dict[str, list[int]] = {}

    @abc.abstractmethod
    async def start(self) -> None:
        """Discover and poll the pods once, then keep polling in the background.

        Awaited once by the router server at startup, on its event loop. Returns
        after the first poll, so `is_ready()` is meaningful immediately after.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop polling and close the pool's own connections. Awaited once at shutdown."""

    @abc.abstractmethod
    def pods(self, role: str) -> list[PodLoad]:
        """Healthy pods of `role`, sorted by address, with current in-flight counts."""

    def pod(self, role: str, address: str) -> PodLoad | None:
        """`address`'s load when it is a healthy pod of `role`, else None."""
        return next((p for p in self.pods(role) if p.address == address), None)

    def addresses(self, role: str) -> AbstractSet[str]:
        """Addresses of the healthy pods of `role`."""
        return {p.address for p in self.pods(role)}

    def by_load(self, role: str) -> Iterator[PodLoad]:
        """Healthy pods of `role` in the load order (`load_key`): the least
        busy first. A pool that keeps the order as loads change overrides it."""
        return iter(sorted(self.pods(role), key=load_key))

    @abc.abstractmethod
    def known(self, role: str) -> list[str]:
        """Addresses of every pod of `role` the registry knows, healthy or not (for messages)."""

    @abc.abstractmethod
    def mark_unhealthy(self, address: str, reason: str) -> None:
        """Take `address` out of rotation now (e.g. the server could not connect to it).

        It comes back on the next successful poll. Called by the server on the
        event loop; unknown addresses are ignored.
        """

    def is_ready(self) -> bool:
        """True when a request can be served: ≥1 healthy prefill and ≥1 healthy decode pod,
        or ≥1 healthy colocated pod."""
        if self.pods("colocated"):
            return True
        return bool(self.pods("prefill")) and bool(self.pods("decode"))

    def in_flight(self, address: str) -> tuple[int, int]:
        """(requests, prompt tokens) this router currently has outstanding at `address`."""
        counts = self._in_flight.get(address)
        return (counts[0], counts[1]) if counts else (0, 0)

    @contextlib.contextmanager
    def track(self, address: str, *, num_tokens: int = 0) -> Iterator[None]:
        """Count one request (of `num_tokens` prompt tokens) toward `address`'s load
        for the duration of the `with` block.

        The server wraps each pod call in it: the Prefill call for a prefill
        pod, the whole Generate stream for a decode or colocated pod. Passing
        `num_tokens` (the prompt length) lets the policy weigh prefill load in
        tokens the moment the request is sent, before the next poll.
        """
        if num_tokens < 0:
            raise ValueError(f"track(num_tokens) must be >= 0; got {num_tokens}")
        counts = self._in_flight.setdefault(address, [0, 0])
        counts[0] += 1
        counts[1] += num_tokens
        self._load_changed(address)
        try:
            yield
        finally:
            counts[0] -= 1
            counts[1] -= num_tokens
            if counts[0] == 0:
                # drop the entry so pods that left the registry do not accumulate
                del self._in_flight[address]
            self._load_changed(address)

    def _load_changed(self, address: str) -> None:
        """This router's in-flight count at `address` changed (for pools that
        keep their views current by change)."""
        return None
