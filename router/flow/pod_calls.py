"""The small pieces of a flow's pod calls, on the router's event loop.

`AttemptFailed` ends one try on one pod pair; `pod_fault`, `client_error`
and `describe` turn pod errors into the flow's decisions (retry elsewhere,
leave the pod out, tell the client); `choose_path` picks colocated or P/D
for the next attempt.
"""

from __future__ import annotations

import enum

import grpc

from proto.roles import PodRole
from router.api_error import ApiError
from router.routing.base import PodLoad, PodPool
from router.routing.colocated_gate import ColocatedGate


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


class PodFault(enum.Enum):
    """What a pod's failed call says about the pod itself (`POD_FAULTS`)."""

    BROKEN = "broken"  # gone or failing
    FULL = "full"  # up, with no room now


_C = grpc.StatusCode
# The one table of what a status code says about the pod that answered it,
# read wherever a failed call moves on to another pod (the prefill retries
# and the transfer verdict in pd_path.py, scoring in score_path.py):
#
# BROKEN: unreachable, a crashed handler, an error the pod did not map.
#   Another pod may succeed and this one would fail again: it is left out
#   for the rest of the request wherever it failed.
# FULL: RESOURCE_EXHAUSTED, up but no room now. Another pod may have room,
#   and this one may again soon: within one attempt's prefill retries (one
#   decode reservation) it is only skipped, and a later attempt may choose
#   it; where a failure ends the attempt at once (a scored prompt) it is
#   left out as a broken pod is, or the next attempt's admission would
#   choose the same full pod again.
# Any other code (INVALID_ARGUMENT, DEADLINE_EXCEEDED, a refused transfer:
#   ABORTED, ...) is the request's or the transfer's fault, not the pod's:
#   nobody is left out for it (client_error turns the client's into its error).
POD_FAULTS: dict[grpc.StatusCode, PodFault] = {
    _C.UNAVAILABLE: PodFault.BROKEN,
    _C.INTERNAL: PodFault.BROKEN,
    _C.UNKNOWN: PodFault.BROKEN,
    _C.RESOURCE_EXHAUSTED: PodFault.FULL,
}


def pod_fault(error: grpc.aio.AioRpcError) -> PodFault | None:
    """What `error` says about the pod that answered it; None: not the pod's fault."""
    return POD_FAULTS.get(error.code())


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


def choose_path(pool: PodPool, left_out: set[str] | frozenset[str],
                gate: ColocatedGate | None = None, num_tokens: int = 1) -> str:
    """"colocated" or "disaggregated" for the next attempt; ApiError 503 when
    neither can serve. `left_out` are pods that already failed this request.

    With both paths up, the request goes to the colocated pod when the least
    busy one runs fewer sequences (running + this router's in-flight) than
    the least busy decode pod; ties go to the P/D pair. Colocated pods whose
    estimated wait until a prompt of `num_tokens` is computed is above
    --max-queue-wait (`gate`) do not count then: the P/D path's own queue
    decides whether the request waits or is shed.
    """
    colocated = [p for p in pool.pods("colocated") if p.address not in left_out]
    decode = [p for p in pool.pods("decode") if p.address not in left_out]
    prefill = [p for p in pool.pods("prefill") if p.address not in left_out]
    if colocated and decode and prefill:
        if gate is not None:
            colocated = [p for p in colocated if gate.over_limit(p.address, num_tokens) is None]
            if not colocated:
                return "disaggregated"

        def busy(pods: list[PodLoad]) -> int:
            return min(p.num_running + p.in_flight for p in pods)
        return "colocated" if busy(colocated) < busy(decode) else "disaggregated"
    if colocated:
        return "colocated"
    if decode and prefill:
        return "disaggregated"
    missing = "prefill" if not prefill else "decode"
    parts = [f"{len(pool.pods(r))}/{len(pool.known(r))} {r} healthy"
             for r in PodRole]
    if left_out:
        parts.append(f"{len(left_out)} failed this request")
    raise ApiError(
        503,
        f"no pod can serve the request: no healthy {missing} pod and no healthy colocated "
        f"pod ({', '.join(parts)})",
        code="no_pod_available",
    )
