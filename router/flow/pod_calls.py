"""What every request flow shares, and the small pieces of its pod calls.

`FlowDeps` is built once by the router server and passed to each
`router.flow.request_flow.RequestFlow`; everything in it is used on the router's event
loop only. The helpers here turn typed router values into proto messages and
pod errors into the flow's decisions (retry elsewhere, tell the client).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from proto import pdserve_pb2 as pb
from router.api_error import ApiError
from router.http.requests import SamplingSpec
from router.metrics import RouterMetrics
from router.pod_clients import PodChannels
from router.routing.base import PodLoad, PodPool
from router.routing.policy import RoutingPolicy


@dataclass(frozen=True, slots=True)
class FlowSettings:
    """The flow's limits, taken from RouterConfig."""

    max_prefill_retries: int = 2
    max_migrations: int = 3
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.max_prefill_retries < 0:
            raise ValueError(f"max_prefill_retries must be >= 0, got {self.max_prefill_retries}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")


@dataclass(frozen=True, slots=True)
class FlowDeps:
    """The router-wide objects a flow uses; owned by the router server."""

    pool: PodPool
    policy: RoutingPolicy
    channels: PodChannels
    metrics: RouterMetrics
    settings: FlowSettings


class AttemptFailed(Exception):
    """One try on one pod pair failed in a way another pair may not.

    `addresses` are the pods to leave out from now on; `migrate` is True
    when the decode side failed (the request moves), False when every
    prefill try failed (the request starts over on a new pair)."""

    def __init__(self, reason: str, *, addresses: frozenset[str], migrate: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.addresses = addresses
        self.migrate = migrate


def sampling_message(spec: SamplingSpec) -> pb.SamplingParams:
    """The wire form of a request's sampling. Pods send logprobs only for
    n > 0, so "just the sampled token's logprob" (n = 0) asks for one
    alternative and the response shaper shows none."""
    message = pb.SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_tokens=spec.max_tokens,
        ignore_eos=spec.ignore_eos,
        logprobs=0 if spec.logprobs is None else max(1, spec.logprobs),
        stop=list(spec.stop),
    )
    if spec.seed is not None:
        message.seed = spec.seed
    return message


def describe(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details() or 'no details'}"


def client_error(error: grpc.aio.AioRpcError, address: str, timeout: float) -> ApiError | None:
    """The ApiError to give the client for a pod's error, or None when the
    error is the pod's (another pod may succeed)."""
    code = error.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, f"the request was refused by pod {address}: {error.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, f"the request did not finish within --request-timeout {timeout:g}s")
    return None


def choose_path(pool: PodPool, left_out: set[str] | frozenset[str]) -> str:
    """"colocated" or "disaggregated" for the next attempt; ApiError 503 when
    neither can serve. `left_out` are pods that already failed this request.

    With both paths up, the request goes to the colocated pod when the least
    busy one runs fewer sequences (running + this router's in-flight) than
    the least busy decode pod; ties go to the P/D pair.
    """
    colocated = [p for p in pool.pods("colocated") if p.address not in left_out]
    decode = [p for p in pool.pods("decode") if p.address not in left_out]
    prefill = [p for p in pool.pods("prefill") if p.address not in left_out]
    if colocated and decode and prefill:
        def busy(pods: list[PodLoad]) -> int:
            return min(p.num_running + p.in_flight for p in pods)
        return "colocated" if busy(colocated) < busy(decode) else "disaggregated"
    if colocated:
        return "colocated"
    if decode and prefill:
        return "disaggregated"
    missing = "prefill" if not prefill else "decode"
    parts = [f"{len(pool.pods(r))}/{len(pool.known(r))} {r} healthy"
             for r in ("prefill", "decode", "colocated")]
    if left_out:
        parts.append(f"{len(left_out)} failed this request")
    raise ApiError(
        503,
        f"no pod can serve the request: no healthy {missing} pod and no healthy colocated "
        f"pod ({', '.join(parts)})",
        code="no_pod_available",
    )
